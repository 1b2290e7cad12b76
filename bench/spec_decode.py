#!/usr/bin/env python3
"""Speculative decoding (n-gram prompt lookup): TPOT with speculation on vs off, same run.

Workloads (issue 15), greedy, 128 output tokens, the built-in model:
* copy: chat prompts that quote a ~300-token passage and ask for it back with a small edit
  (replace one word), so the answer repeats the prompt: drafts are mostly accepted;
* random: prompts of random token ids (no text to copy): drafts rarely exist or pay, and the
  auto-off rules must keep it from costing anything.
Concurrency 1, 4 and 64 (closed loop: that many requests in flight until the wave is done).

Per configuration: median TPOT over requests ((t_last - t_first) / (tokens - 1)), plain vs
speculative engine (each its own LLMEngine in this process, loaded once, warmed up), off then
on, in wall time and in this process's CPU time (all threads: robust to other people's load on
a shared machine, which stretches wall time; the target verdict uses it), the ratio plain/spec
(> 1: speculation is faster) against the issue's target, and the acceptance rate (accepted /
draft tokens) with the number of drafts.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

WORDS = ("the a river town keeper light ship harbour evening morning winter summer old new small "
         "great quiet bright dark stone wooden bridge road market garden window door lamp clock "
         "bell tower field hill forest cloud rain wind snow sea coast island boat sail net fish "
         "baker smith teacher child mother father friend neighbour walked carried watched opened "
         "closed painted mended counted sang called waited found left kept brought over under "
         "across beside through after before while because and but slowly carefully every each").split()
TARGETS = {("copy", 1): 1.8, ("copy", 4): 1.4, ("copy", 64): 0.97,
           ("random", 1): 0.97, ("random", 4): 0.97, ("random", 64): 0.97}


def passage(rng: random.Random, num_words: int) -> str:
    sentences, words = [], 0
    while words < num_words:
        n = rng.randint(8, 16)
        s = " ".join(rng.choice(WORDS) for _ in range(n))
        sentences.append(s[0].upper() + s[1:] + ".")
        words += n
    return " ".join(sentences)


def copy_prompts(engine, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text = passage(rng, 220)  # ~300 tokens
        old, new = rng.choice(WORDS[:40]), rng.choice(WORDS[40:80])
        msg = (f"Rewrite the passage below, replacing every '{old}' with '{new}'. Change nothing "
               f"else and add no comment.\n\n{text}")
        out.append(engine.tokenizer.encode_chat([{"role": "user", "content": msg}]))
    return out


def random_prompts(n: int, seed: int, vocab: int, length: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def run_wave(engine, prompts: list[list[int]], concurrency: int, max_tokens: int
             ) -> tuple[list[float], list[float]]:
    """Closed loop at `concurrency`; each request's TPOT (seconds), in wall time and in this
    process's CPU time (all threads). On a shared machine the CPU-time TPOT is the steadier
    measure: other people's processes stretch wall time, not the work this process does."""
    from kvmesh.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    todo = list(prompts)
    first: dict[str, tuple[float, float]] = {}
    wall_tpots: list[float] = []
    cpu_tpots: list[float] = []
    in_flight = 0
    while todo or in_flight:
        while todo and in_flight < concurrency:
            engine.add_request(todo.pop(0), params)
            in_flight += 1
        outs = engine.step()
        now, cpu = time.perf_counter(), time.process_time()
        for o in outs:
            if o.delta_token_ids and o.request_id not in first:
                first[o.request_id] = (now, cpu)
            if o.finished:
                in_flight -= 1
                n = len(o.token_ids)
                if n > 1:
                    wall_tpots.append((now - first[o.request_id][0]) / (n - 1))
                    cpu_tpots.append((cpu - first[o.request_id][1]) / (n - 1))
    return wall_tpots, cpu_tpots


def spec_counts(engine) -> tuple[int, int, int]:
    s = engine.core.stats().spec_decode
    return (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) if s else (0, 0, 0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--concurrency", default="1,4,64")
    ap.add_argument("--workloads", default="copy,random")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4, '
                                                    '"prompt_lookup_max": 4, "prompt_lookup_min": 2}')
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--order", default="off,on", help="which engine runs each configuration first")
    ap.add_argument("--num-requests", type=int, default=None, help="per configuration (default: max(c, 2))")
    args = ap.parse_args()

    from kvmesh.engine import EngineArgs, SamplingParams
    from kvmesh.engine.llm_engine import LLMEngine

    spec_cfg = json.loads(args.speculative_config)
    common = dict(model=args.model, kv_cache_memory=args.kv_cache_memory, max_num_seqs=128)
    engines = {"off": LLMEngine(EngineArgs(**common)),
               "on": LLMEngine(EngineArgs(**common, speculative_config=spec_cfg))}
    vocab = engines["off"].core.model_config.vocab_size
    for e in engines.values():  # warm-up (kernels, allocator)
        e.add_request(list(range(100, 164)), SamplingParams(max_tokens=8, temperature=0.0))
        while e.has_unfinished_requests():
            e.step()
    print(f"model {args.model}, {args.max_tokens} output tokens, greedy; speculative_config {spec_cfg} "
          f"(disable_by_batch_size {engines['on'].core.spec.config.disable_by_batch_size})")
    seed = 0
    for workload in args.workloads.split(","):
        for c in [int(x) for x in args.concurrency.split(",")]:
            n = args.num_requests or max(c, 2)
            seed += 1
            prompts = (copy_prompts(engines["off"], n, seed) if workload == "copy"
                       else random_prompts(n, seed, vocab))
            result = {}
            for mode in args.order.split(","):
                before = spec_counts(engines[mode])
                t0 = time.perf_counter()
                wall_tpots, cpu_tpots = run_wave(engines[mode], prompts, c, args.max_tokens)
                wall = time.perf_counter() - t0
                after = spec_counts(engines[mode])
                result[mode] = (statistics.median(wall_tpots), statistics.median(cpu_tpots), wall,
                                [a - b for a, b in zip(after, before)])
            (off, off_cpu, wall_off, _) = result["off"]
            (on, on_cpu, wall_on, (drafts, draft_toks, accepted)) = result["on"]
            ratio, ratio_cpu = off / on, off_cpu / on_cpu
            target = TARGETS.get((workload, c))
            verdict = "" if target is None else \
                f" (target >= {target}x: {'met' if ratio_cpu >= target else 'MISSED'} by CPU time)"
            acc = f"{accepted / draft_toks:.2f}" if draft_toks else "-"
            print(f"{workload:6s} c={c:<3d} n={n:<3d} median TPOT wall off {off * 1e3:7.1f} ms on {on * 1e3:7.1f} ms "
                  f"= {ratio:5.2f}x | CPU-time off {off_cpu * 1e3:7.1f} ms on {on_cpu * 1e3:7.1f} ms = {ratio_cpu:5.2f}x"
                  f"{verdict} | acceptance {acc} ({accepted}/{draft_toks} tokens, {drafts} drafts) | "
                  f"wall off {wall_off:.0f}s on {wall_on:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
