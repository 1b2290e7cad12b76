#!/usr/bin/env python3
"""GPU greedy parity: kvmesh (Triton backend, CUDA graphs and eager) against transformers on the
same GPU, fp32 and bf16, on the built-in model (part of bench/gpu_check.sh); async scheduling
(the CUDA default) with graphs (full decode graphs, piecewise graphs for the other steps) and
eager, synchronous with graphs, and piecewise graphs for every step (--engine-modes piecewise-sync).

fp32 must match token for token (the kernels multiply in IEEE fp32, not TF32), also with speculative
decoding (n-gram drafts verified through the Triton backend), except at a near-tie: where the two
first differ, transformers' own logits of its token and the engine's must be within NEAR_TIE (the
random-weight checkpoint that stands in for the built-in model on a machine without it has flat
logits, where summation order alone can flip an argmax). Exit 1 otherwise; the gaps are printed.
bf16 is reported (prompts identical, tokens matching before the first divergence): two bf16
implementations round differently, so a late divergence on a near-tie is expected. Each bf16
divergence is weighed in transformers' own runs at that position (same prefix): its bf16 logit gap
between its token and the engine's, the same gap in fp32 (teacher-forced), and transformers' bf16
rounding there (the largest |bf16 - fp32| logit of the row). A near-tie: the fp32 gap is within
twice that rounding (either token may win in bf16); otherwise the divergence is beyond rounding.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

# fp32: a divergence passes only at a near-tie, where transformers' own logits for the two tokens
# differ by less than this (two fp32 implementations summing in different orders, over 30 layers).
NEAR_TIE = 1e-3
# Drafts from single-token matches too, always on: random weights rarely repeat a 2-gram.
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
    "acceptance_threshold": 0.0,
    "disable_by_batch_size": None,
}


def hf_greedy(model_dir, dtype, prompts, max_new_tokens, attn_implementation="sdpa"):
    import torch
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from transformers import GenerationConfig

    hf = (
        AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, attn_implementation=attn_implementation
        )
        .cuda()
        .eval()
    )
    hf.generation_config.eos_token_id = (
        None  # as ignore_eos: EOS may be generated, and does not stop
    )
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=None,
        pad_token_id=hf.config.pad_token_id or 0,
        return_dict_in_generate=True,
        output_logits=True,
    )
    outs, logits = [], []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            # An explicit mask: the chat template's <|im_end|> is the pad id, which generate() would
            # otherwise take for padding and mask out of the prompt.
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            outs.append(out.sequences[0, len(p) :].tolist())
            logits.append([step[0].float().cpu() for step in out.logits])
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return outs, logits


def first_divergence(got: list[int], expected: list[int]) -> int:
    """The number of tokens the two agree on before they first differ (all of them if never)."""
    return next((j for j, (a, b) in enumerate(zip(got, expected)) if a != b), len(expected))


def divergence_gaps(got, expected, logits) -> list[tuple[int, int, float]]:
    """(prompt, position, gap) at each prompt's first divergence: how far below transformers' best
    logit the engine's token scored there. Both agree on every token before it, so transformers'
    logits at that position are the ones the engine computed too, up to rounding: a gap within
    rounding (a near-tie) says the two computed the same thing; a larger one, a real difference."""
    gaps = []
    for i, (g, e) in enumerate(zip(got, expected)):
        n = first_divergence(g, e)
        if n < len(e):
            row = logits[i][n]
            gaps.append((i, n, float(row[e[n]] - row[g[n]])))
    return gaps


def fp32_weighing(model_dir, prompts, expected, gaps, hf_logits) -> list[dict]:
    """Each bf16 divergence (prompt, position, bf16 gap) in transformers fp32, teacher-forced on
    the prefix both runs shared: the fp32 gap between transformers' token and the engine's, and
    transformers' own bf16 rounding at that position (max |bf16 - fp32| over the row)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = (
        AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="sdpa"
        )
        .cuda()
        .eval()
    )
    out = []
    with torch.inference_mode():
        for i, n, gap16, got_tok in gaps:
            ids = torch.tensor([prompts[i] + expected[i][:n]], device="cuda")
            row32 = hf(ids).logits[0, -1].float().cpu()
            row16 = hf_logits[i][n]
            gap32 = float(row32[expected[i][n]] - row32[got_tok])
            noise = float((row16 - row32).abs().max())
            out.append(
                {
                    "prompt": i,
                    "position": n,
                    "gap_bf16": round(gap16, 5),
                    "gap_fp32": round(gap32, 5),
                    "bf16_rounding": round(noise, 5),
                    "verdict": "near-tie" if abs(gap32) <= 2 * noise else "beyond rounding",
                }
            )
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument(
        "--reference-dtype",
        default=None,
        help="transformers' dtype for the fp32 reference (float64: which side rounds off)",
    )
    ap.add_argument(
        "--hf-attention", default="sdpa", help="transformers' attn_implementation (sdpa, eager)"
    )
    ap.add_argument("--engine-modes", default="graphs-async,eager-async,graphs-sync,spec")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    report: dict = {"prompts": 8, "max_tokens": args.max_tokens, "runs": []}

    def save() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))

    import torch

    from kvmesh.common.tokenizer import KVMeshTokenizer
    from kvmesh.engine import LLM, SamplingParams
    from kvmesh.engine.builtin import resolve_model_dir

    model_dir = str(resolve_model_dir(args.model))
    tok = KVMeshTokenizer(model_dir)
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain gravity to a child.",
        "List three fruits.",
        "How do I boil an egg?",
        "What does a KV cache store?",
        "Describe a cat in one sentence.",
        "Why is the sky blue?",
    ]
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in questions]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    failed = False
    modes = args.engine_modes.split(",")
    for dtype in args.dtypes.split(","):
        ref = args.reference_dtype if dtype == "float32" and args.reference_dtype else dtype
        expected, hf_logits = hf_greedy(
            model_dir, getattr(torch, ref), prompts, args.max_tokens, args.hf_attention
        )
        if ref != dtype or args.hf_attention != "sdpa":
            print(f"reference: transformers {ref}, attention {args.hf_attention}", flush=True)
        for graphs, async_scheduling in [
            (m.split("-")[0], m.endswith("-async")) for m in modes if m != "spec"
        ]:
            # graphs: full decode graphs + piecewise for the rest (the default); piecewise: every
            # step through the pieces; eager: none
            llm = LLM(
                args.model,
                dtype=dtype,
                device="cuda",
                attention_backend="triton",
                enforce_eager=graphs == "eager",
                compilation_config={"cudagraph_mode": "PIECEWISE"}
                if graphs == "piecewise"
                else None,
                gpu_memory_utilization=0.5,
                max_num_seqs=16,
                async_scheduling=async_scheduling,
            )
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
            same = sum(g == e for g, e in zip(got, expected))
            prefix = [first_divergence(g, e) for g, e in zip(got, expected)]
            mode = {"eager": "eager", "piecewise": "piecewise"}.get(graphs, "cuda-graphs") + (
                " async" if async_scheduling else " sync"
            )
            gaps = divergence_gaps(got, expected, hf_logits)
            worst = max((gap for _, _, gap in gaps), default=0.0)
            print(
                f"parity {dtype:<9} {mode:<17}: {same}/{len(prompts)} prompts identical to transformers; "
                f"tokens before first divergence: {prefix} (of {args.max_tokens}); logit gap at each "
                f"divergence: {[round(gap, 6) for _, _, gap in gaps]}",
                flush=True,
            )
            run = {
                "dtype": dtype,
                "mode": mode,
                "identical": same,
                "prompts": len(prompts),
                "prefix": prefix,
                "gaps": [{"prompt": i, "position": n, "gap": round(gap, 6)} for i, n, gap in gaps],
            }
            if dtype != "float32" and gaps:
                weighed = fp32_weighing(
                    model_dir,
                    prompts,
                    expected,
                    [(i, n, gap, got[i][n]) for i, n, gap in gaps],
                    hf_logits,
                )
                run["gaps"] = weighed
                for w in weighed:
                    print(
                        f"   prompt {w['prompt']} token {w['position']}: transformers' gap bf16 {w['gap_bf16']:.4f}, "
                        f"fp32 {w['gap_fp32']:.4f}; its bf16 rounding there {w['bf16_rounding']:.4f} -> "
                        f"{w['verdict']}",
                        flush=True,
                    )
                ties = sum(w["verdict"] == "near-tie" for w in weighed)
                print(
                    f"   {dtype} {mode}: {same}/{len(prompts)} identical; of {len(weighed)} divergences "
                    f"{ties} near-ties, {len(weighed) - ties} beyond rounding",
                    flush=True,
                )
            report["runs"].append(run)
            save()
            if dtype == "float32" and worst > NEAR_TIE:
                failed = True
            runner = llm.engine.core.runner
            if runner.graphs is not None or runner.piecewise is not None:
                print(
                    f"  steps replayed: {runner.graphs.num_replays if runner.graphs else 0} from full decode "
                    f"graphs, {runner.piecewise.num_replays if runner.piecewise else 0} from piecewise graphs",
                    flush=True,
                )
            del llm
            gc.collect()
            torch.cuda.empty_cache()
        if (
            dtype == "float32" and "spec" in modes
        ):  # speculative decoding: verification rows through the Triton backend
            llm = LLM(
                args.model,
                dtype=dtype,
                device="cuda",
                attention_backend="triton",
                max_num_seqs=16,
                gpu_memory_utilization=0.5,
                speculative_config=SPEC,
            )
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
            same = sum(g == e for g, e in zip(got, expected))
            s = llm.stats().spec_decode
            gaps = divergence_gaps(got, expected, hf_logits)
            print(
                f"parity {dtype:<9} speculative: {same}/{len(prompts)} prompts identical to transformers; "
                f"{s.num_drafts} drafts, {s.num_accepted_tokens}/{s.num_draft_tokens} draft tokens accepted; "
                f"logit gap at each divergence: {[round(gap, 6) for _, _, gap in gaps]}",
                flush=True,
            )
            failed |= max((gap for _, _, gap in gaps), default=0.0) > NEAR_TIE
            report["runs"].append(
                {
                    "dtype": dtype,
                    "mode": "speculative",
                    "identical": same,
                    "prompts": len(prompts),
                    "drafts": s.num_drafts,
                    "accepted": s.num_accepted_tokens,
                    "draft_tokens": s.num_draft_tokens,
                    "gaps": [
                        {"prompt": i, "position": n, "gap": round(gap, 6)} for i, n, gap in gaps
                    ],
                }
            )
            save()
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    print(
        f"PARITY FAIL (fp32: a divergence with a logit gap above {NEAR_TIE})"
        if failed
        else "parity ok",
        flush=True,
    )
    report["fp32_ok"] = not failed
    save()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
