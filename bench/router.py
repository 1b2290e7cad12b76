"""Router benchmarks (a script, not a test).

overhead   Router overhead against a stub upstream: 16 pods registered in a real Redis
           (heartbeats + block sets), 2,000-token prompts, sequential requests; reports
           p50/p90/p99 latency through the router and straight to the upstream, and the
           difference (the issue's target: p50 overhead <= 2 ms).

multiround A multi-round chat workload (users sharing a system prompt, each round appending
           the previous answer and a new user turn, random think times) against `kvmesh up`
           with 4 replicas whose caches each hold 0.4 of the working set: prefix vs
           round-robin, the fleet's prefix-cache hit rate (engine /metrics), TTFT and
           throughput. Starts `kvmesh up` itself for each policy (`--engine-command stub`
           for a quick run without the model), or measures one running mesh with `--url`.
           docs/router.md explains the sizing.

tool-tokenize
           The router's tokenization (ids and block keys) of a chat request carrying tools, against
           the same request without them (what the router computed before it rendered tools),
           measured in the same run; the model's template (tools in the system prompt) and one
           that reads `tools` (as Qwen 2.5's and Llama 3.1's do).

    python bench/router.py overhead
    python bench/router.py multiround [--replicas 4] [--engine-command stub]
    python bench/router.py tool-tokenize [--tools 10]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "bench"))  # local_mesh.py

from local_mesh import local_mesh  # noqa: E402

from kvmesh.common.ports import free_port  # noqa: E402


def env() -> dict[str, str]:
    e = dict(os.environ)
    return e


def wait_http(url: str, timeout: float = 60, until=None) -> None:
    """Until `url` answers 200 and, if given, `until(response)` holds."""
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            r = httpx.get(url, timeout=1)
            if r.status_code == 200 and (until is None or until(r)):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} did not come up")


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


# -- overhead ------------------------------------------------------------------------------------
def vocabulary(n: int = 3000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    words = set()
    while len(words) < n:
        words.add(
            "".join(rng.choice(letters[: rng.randint(8, 26)]) for _ in range(rng.randint(2, 9)))
        )
    return sorted(words)


def make_prompt(rng: random.Random, words: list[str], n_words: int) -> str:
    # Zipf-like word frequencies, some punctuation and numbers: roughly natural text.
    out = []
    for _ in range(n_words):
        w = (
            words[min(int(rng.paretovariate(1.1)) - 1, len(words) - 1)]
            if rng.random() < 0.8
            else rng.choice(words)
        )
        out.append(w)
        if rng.random() < 0.08:
            out[-1] += rng.choice([",", ".", ";", ":"])
        if rng.random() < 0.02:
            out.append(str(rng.randint(0, 9999)))
    return " ".join(out)


def overhead(args: argparse.Namespace) -> None:
    import redis

    from kvmesh.common import redis_layout as rl
    from kvmesh.common.block_keys import block_keys, key_hex
    from kvmesh.common.model_lookup import find_model_dir
    from kvmesh.common.tokenizer import KVMeshTokenizer
    from kvmesh.mesh.redis_server import redis_server_argv

    procs: list[subprocess.Popen] = []
    tmp = tempfile.mkdtemp(prefix="kvmesh-bench-")
    try:
        rport, sport, port = free_port(), free_port(), free_port()
        procs.append(
            subprocess.Popen(
                redis_server_argv(rport, tmp),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        redis_url = f"redis://127.0.0.1:{rport}/0"
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kvmesh.mesh.stub_engine",
                    "--port",
                    str(sport),
                    "--no-tokenize",
                    "--response-tokens",
                    "1",
                ],
                env=env(),
                stdout=subprocess.DEVNULL,
            )
        )
        profile = (
            ["-m", "cProfile", "-o", os.environ["KVMESH_BENCH_PROFILE"]]
            if os.environ.get("KVMESH_BENCH_PROFILE")
            else []
        )
        router_cmd = [
            sys.executable,
            *profile,
            "-m",
            "kvmesh.cli",
            "router",
            "--model",
            "bench-model",
            "--tokenizer",
            "smollm2-135m-instruct",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--redis-url",
            redis_url,
            "--policy",
            args.policy,
            "--static-backends",  # the platform's list; Redis adds load
            ",".join(f"bench-pod-{i:02d}=http://127.0.0.1:{sport}" for i in range(args.pods)),
        ]
        if args.no_access_log:
            router_cmd.append("--no-access-log")
        procs.append(subprocess.Popen(router_cmd, env=env(), stderr=subprocess.DEVNULL))
        wait_http(f"http://127.0.0.1:{sport}/health")

        # 16 pods in Redis, all pointing at the stub; each holds a different prefix of some prompts.
        tok = KVMeshTokenizer(find_model_dir("smollm2-135m-instruct"))
        rng = random.Random(1)
        words = vocabulary()
        prompts = [make_prompt(rng, words, args.words) for _ in range(args.requests + args.warmup)]
        n_tokens = [len(tok.encode(p)) for p in prompts[:20]]
        r = redis.Redis.from_url(redis_url)
        pods = [f"bench-pod-{i:02d}" for i in range(args.pods)]
        pipe = r.pipeline()
        for j, p in enumerate(prompts):
            keys = [key_hex(k) for k in block_keys(tok.encode(p), "bench-model")]
            for i, pod in enumerate(pods):
                if (i + j) % 4 == 0:  # a quarter of the pods hold some prefix of each prompt
                    pipe.sadd(
                        rl.blocks_key("bench-model", pod),
                        *keys[: max(1, len(keys) * ((i % 4) + 1) // 5)],
                    )
        pipe.execute()
        stop = threading.Event()

        def heartbeats():
            while not stop.is_set():
                pipe = r.pipeline()
                for i, pod in enumerate(pods):
                    hb = rl.Heartbeat(
                        pod=pod,
                        url=f"http://127.0.0.1:{sport}",
                        model="bench-model",
                        kv_usage=0.1 + 0.02 * i,
                        running=i % 3,
                        waiting=0,
                        total_blocks=4096,
                    )
                    pipe.hset(rl.heartbeat_key("bench-model", pod), mapping=hb.to_mapping())
                    pipe.expire(rl.heartbeat_key("bench-model", pod), rl.HEARTBEAT_TTL_S)
                    pipe.sadd(rl.pods_key("bench-model"), pod)
                pipe.execute()
                stop.wait(1)

        threading.Thread(target=heartbeats, daemon=True).start()
        wait_http(f"http://127.0.0.1:{port}/ready")
        time.sleep(1.0)

        async def measure(base: str) -> list[float]:
            import aiohttp

            out = []
            async with aiohttp.ClientSession() as s:
                for i, p in enumerate(prompts):
                    body = json.dumps(
                        {"model": "bench-model", "prompt": p, "max_tokens": 1}
                    ).encode()
                    t0 = time.perf_counter()
                    async with s.post(
                        base + "/v1/completions",
                        data=body,
                        headers={"Content-Type": "application/json"},
                    ) as resp:
                        await resp.read()
                        assert resp.status == 200, resp.status
                    if i >= args.warmup:
                        out.append(time.perf_counter() - t0)
            return out

        # The router's per-request work without HTTP, in this process (same code, same Redis).
        from kvmesh.router.fast_tokenize import FastEncoder

        fe = FastEncoder(tok)
        match = r.register_script(rl.PREFIX_MATCH_LUA)
        bkeys = [rl.blocks_key("bench-model", pod) for pod in pods]
        parts = {"json": [], "tokenize": [], "block keys": [], "redis match (16 pods)": []}
        for p in prompts[: args.warmup] + prompts:
            body = json.dumps({"prompt": p})
            t0 = time.perf_counter()
            json.loads(body)
            t1 = time.perf_counter()
            ids = fe.encode(p)
            t2 = time.perf_counter()
            ks = block_keys(ids, "bench-model")
            t3 = time.perf_counter()
            match(keys=bkeys, args=["".join(key_hex(k) for k in ks)])
            t4 = time.perf_counter()
            for name, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                parts[name].append(dt)
        component_report = "  per-request work, p50: " + ", ".join(
            f"{name} {statistics.median(xs[args.warmup :]) * 1000:.3f} ms"
            for name, xs in parts.items()
        )

        direct = asyncio.run(measure(f"http://127.0.0.1:{sport}"))
        routed = asyncio.run(measure(f"http://127.0.0.1:{port}"))
        direct2 = asyncio.run(measure(f"http://127.0.0.1:{sport}"))
        direct = (
            [min(a, b) for a, b in zip(direct, direct2)] if args.min_direct else direct + direct2
        )
        stop.set()
        import httpx

        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        decisions = {
            line.split("{")[1].split("}")[0]: line.rsplit(" ", 1)[1]
            for line in metrics.splitlines()
            if line.startswith("kvmesh_router_decisions_total{")
        }
        ms = lambda x: f"{x * 1000:.3f} ms"  # noqa: E731
        print(
            f"router overhead benchmark: {args.pods} pods in Redis, prompts ~{int(statistics.mean(n_tokens))} "
            f"tokens ({args.words} words), {len(routed)} sequential requests, policy {args.policy}"
        )
        for name, xs in (("direct to upstream", direct), ("through the router", routed)):
            print(
                f"  {name:20s} p50 {ms(pct(xs, 50))}  p90 {ms(pct(xs, 90))}  p99 {ms(pct(xs, 99))}"
            )
        ov50 = pct(routed, 50) - pct(direct, 50)
        print(
            f"  router overhead      p50 {ms(ov50)}  p90 {ms(pct(routed, 90) - pct(direct, 90))}"
            f"   (target p50 <= 2 ms: {'OK' if ov50 <= 0.002 else 'MISSED'})"
        )
        buckets = {}
        for line in metrics.splitlines():
            if line.startswith("kvmesh_router_overhead_seconds_bucket{"):
                le = line.split('le="')[1].split('"')[0]
                buckets[le] = float(line.rsplit(" ", 1)[1])
        total = buckets.get("+Inf", 0) or 1
        print(
            "  router-measured time from request received to upstream request sent: "
            + ", ".join(
                f"<= {float(le) * 1000:g} ms: {n / total:.0%}"
                for le, n in buckets.items()
                if le in ("0.0005", "0.001", "0.002", "0.005")
            )
        )
        print(component_report)
        print(f"  decisions: {decisions}")
        load = os.getloadavg()[0]
        print(
            f"  machine: {os.cpu_count()} CPUs, load average {load:.1f} at the end"
            + (
                "  (busy machine: latencies include waiting for a CPU)"
                if load > (os.cpu_count() or 1)
                else ""
            )
        )
    finally:
        for p in reversed(procs):
            p.send_signal(signal.SIGINT if p is procs[-1] else signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


# -- multi-round chat ----------------------------------------------------------------------------
QUESTIONS = [
    "What is a KV cache?",
    "Why does prefix caching help chat?",
    "Explain paged attention briefly.",
    "How would you route requests between replicas?",
    "What limits batch size?",
    "Summarise our conversation so far.",
    "Give one more example.",
    "What are the trade-offs?",
]
SYSTEM = (
    "You are a patient systems tutor. You answer precisely, you cite trade-offs, and you keep "
    "answers short. "
)


def user_turn(c: int, rnd: int, words: list[str], user_words: int, seed: int) -> str:
    """A question with a pasted snippet: per-user history, not shared with anyone else."""
    rng = random.Random(f"{seed}:{c}:{rnd}")
    snippet = make_prompt(rng, words, user_words) if user_words else ""
    return f"[user {c}] {QUESTIONS[(c + rnd) % len(QUESTIONS)]}" + (
        f"\n\n{snippet}" if snippet else ""
    )


def working_set_blocks(
    model: str,
    conversations: int,
    rounds: int,
    max_tokens: int,
    user_words: int,
    system_repeat: int,
    seed: int,
    block_size: int = 16,
) -> tuple[int, int]:
    """(blocks of all conversations' final prompts, blocks of the longest one), answers at max_tokens."""
    from kvmesh.common.model_lookup import find_model_dir
    from kvmesh.common.tokenizer import KVMeshTokenizer

    tok = KVMeshTokenizer(find_model_dir(model))
    words = vocabulary()
    total, longest = 0, 0
    for c in range(conversations):
        msgs = [{"role": "system", "content": SYSTEM * system_repeat}]
        for rnd in range(rounds):
            msgs.append({"role": "user", "content": user_turn(c, rnd, words, user_words, seed)})
            msgs.append({"role": "assistant", "content": "word " * max_tokens})
        n = -(-len(tok.encode_chat(msgs)) // block_size)
        total, longest = total + n, max(longest, n)
    return total, longest


async def chat_workload(
    base: str,
    model: str,
    conversations: int,
    rounds: int,
    concurrency: int,
    max_tokens: int,
    system_repeat: int = 2,
    user_words: int = 0,
    think_s: float = 0.0,
    seed: int = 0,
) -> dict:
    """Conversations run side by side; each user waits a random think time (exponential, seeded)
    before each round, so arrivals interleave in no fixed order (a shared FIFO queue would cycle
    through the users in a fixed order, which round-robin turns into accidental affinity).
    `concurrency` > 0 caps the requests in flight."""
    import aiohttp

    system = SYSTEM * system_repeat
    words = vocabulary()
    stats = {
        "prompt_tokens": 0,
        "cached_tokens": 0,
        "ttft": [],
        "errors": 0,
        "pods": {},
        "same_pod": [0, 0],
    }
    sem = asyncio.Semaphore(concurrency) if concurrency > 0 else contextlib.nullcontext()

    async def conversation(s, c: int):
        last_pod = None
        rng = random.Random(f"{seed}:think:{c}")
        msgs = [{"role": "system", "content": system}]
        for rnd in range(rounds):
            msgs.append({"role": "user", "content": user_turn(c, rnd, words, user_words, seed)})
            body = {
                "model": model,
                "messages": msgs,
                "max_tokens": max_tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if think_s:
                await asyncio.sleep(rng.expovariate(1 / think_s))
            async with sem:
                t0 = time.perf_counter()
                answer, usage, ttft = [], None, None
                try:
                    async with s.post(
                        base + "/v1/chat/completions",
                        json=body,
                        headers={"X-Session-Id": f"conv-{c}"},
                    ) as resp:
                        if resp.status != 200:
                            stats["errors"] += 1
                            await resp.read()
                            continue
                        pod = resp.headers.get("x-kvmesh-pod", "?")
                        stats["pods"][pod] = stats["pods"].get(pod, 0) + 1
                        if (
                            last_pod is not None
                        ):  # did this round go where the conversation's history is?
                            stats["same_pod"][0] += pod == last_pod
                            stats["same_pod"][1] += 1
                        last_pod = pod
                        async for raw in resp.content:
                            line = raw.decode().strip()
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            chunk = json.loads(line[6:])
                            if chunk.get("usage"):
                                usage = chunk["usage"]
                            for ch in chunk.get("choices") or []:
                                delta = (ch.get("delta") or {}).get("content")
                                if delta:
                                    if ttft is None:
                                        ttft = time.perf_counter() - t0
                                    answer.append(delta)
                except aiohttp.ClientError:
                    stats["errors"] += 1
                    continue
            if ttft is not None:
                stats["ttft"].append(ttft)
            if usage:
                stats["prompt_tokens"] += usage.get("prompt_tokens", 0)
                stats["cached_tokens"] += (usage.get("prompt_tokens_details") or {}).get(
                    "cached_tokens"
                ) or 0
            msgs.append({"role": "assistant", "content": "".join(answer)})

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as s:
        await asyncio.gather(*(conversation(s, c) for c in range(conversations)))
    return stats


def engine_counters(redis_url: str, model: str) -> dict[str, dict[str, float]]:
    """Each engine's own prefix-cache counters, scraped from its /metrics (URLs from the heartbeats)."""
    import httpx
    import redis

    from kvmesh.common import redis_layout as rl
    from kvmesh.common.engine_load import engine_load, parse_prometheus

    r = redis.Redis.from_url(redis_url, decode_responses=True)
    out = {}
    for pod in sorted(r.smembers(rl.pods_key(model))):
        url = r.hget(rl.heartbeat_key(model, pod), rl.F_URL)
        if not url:
            continue
        text = httpx.get(url.rstrip("/") + "/metrics", timeout=10).text
        load = engine_load(text)  # the sidecar's reader of the same counters
        out[pod] = {
            "prefix_cache_queries": load.prefix_cache_queries,
            "prefix_cache_hits": load.prefix_cache_hits,
            "num_preemptions": sum(
                v
                for name, _, v in parse_prometheus(text)
                if name in ("vllm:num_preemptions_total", "vllm:num_preemptions")
            ),
        }
    return out


def fleet_hit_rate(before: dict, after: dict) -> tuple[float, float, float]:
    q = sum(
        after[p].get("prefix_cache_queries", 0) - before.get(p, {}).get("prefix_cache_queries", 0)
        for p in after
    )
    h = sum(
        after[p].get("prefix_cache_hits", 0) - before.get(p, {}).get("prefix_cache_hits", 0)
        for p in after
    )
    pre = sum(
        after[p].get("num_preemptions", 0) - before.get(p, {}).get("num_preemptions", 0)
        for p in after
    )
    return (h / q if q else 0.0), q, pre


def report(policy: str, st: dict) -> None:
    ttft = st["ttft"] or [float("nan")]
    print(
        f"  {policy:12s} fleet hit rate {st['fleet_hit']:6.1%} (engine metrics; per request "
        f"{st['cached_tokens'] / max(st['prompt_tokens'], 1):6.1%})  TTFT p50 {pct(ttft, 50) * 1000:7.1f} ms  "
        f"p90 {pct(ttft, 90) * 1000:7.1f} ms  {st['requests_done'] / st['wall']:5.2f} req/s  "
        f"{st['prompt_tokens'] / st['wall']:6.1f} prompt tok/s  same pod as the previous round "
        f"{st['same_pod'][0] / max(st['same_pod'][1], 1):4.0%}  preemptions {st['preemptions']:.0f}  "
        f"errors {st['errors']}  per pod {dict(sorted(st['pods'].items()))}",
        flush=True,
    )


def compare(results: dict[str, dict]) -> None:
    if "prefix" not in results or "round-robin" not in results:
        return
    p, r = results["prefix"], results["round-robin"]
    hit_x = p["fleet_hit"] / max(r["fleet_hit"], 1e-9)
    ttft_x = pct(p["ttft"], 50) / pct(r["ttft"], 50)
    print(
        f"  prefix vs round-robin: fleet hit rate {hit_x:.2f}x (target >= 1.5x: {'OK' if hit_x >= 1.5 else 'MISSED'}), "
        f"median TTFT {ttft_x:.2f}x (target <= 0.7x: {'OK' if ttft_x <= 0.7 else 'MISSED'}), "
        f"p90 TTFT {pct(p['ttft'], 90) / pct(r['ttft'], 90):.2f}x, throughput {r['wall'] / p['wall']:.2f}x"
    )


def multiround(args: argparse.Namespace) -> None:
    if args.url:
        st = asyncio.run(
            chat_workload(
                args.url.rstrip("/"),
                args.model,
                args.conversations,
                args.rounds,
                args.concurrency,
                args.max_tokens,
                args.system_repeat,
                args.user_words,
                args.think_time,
                args.seed,
            )
        )
        st.update(fleet_hit=float("nan"), wall=float("nan"), requests_done=0, preemptions=0)
        report("(as running)", st)
        return
    engine_args = args.engine_args or ""
    total, longest = working_set_blocks(
        args.model,
        args.conversations,
        args.rounds,
        args.max_tokens,
        args.user_words,
        args.system_repeat,
        args.seed,
    )
    sizing = ""
    if "--num-kv-blocks" not in engine_args and not args.engine_command:
        # Each replica's cache holds a fraction of the whole working set: more than its share under
        # affinity (1/replicas), less than all of it (what round-robin spreads over every replica).
        blocks = max(int(total * args.cache_fraction), longest * 4)
        engine_args = f"{engine_args} --num-kv-blocks {blocks}".strip()
        sizing = f"; each replica's cache {blocks} blocks = {blocks / total:.2f} of it"
    print(
        f"multi-round chat: {args.conversations} conversations x {args.rounds} rounds, {args.user_words} words of "
        f"new text per user turn, {args.max_tokens} tokens per answer, think time {args.think_time} s, concurrency "
        f"{args.concurrency}, {args.replicas} replicas\n  working set {total} blocks (longest conversation "
        f"{longest}){sizing}; engine args {engine_args!r}",
        flush=True,
    )
    results: dict[str, dict] = {}
    for policy in args.policies.split(","):
        flags = ["--policy", policy]
        if args.engine_command:
            flags += ["--engine-command", args.engine_command]
        if engine_args:
            flags += ["--engine-args", engine_args]
        with local_mesh(args.replicas, flags, args.verbose, policy) as mesh:
            state = mesh.state()
            before = engine_counters(state["redis_url"], state["model"])
            t0 = time.perf_counter()
            st = asyncio.run(
                chat_workload(
                    mesh.url,
                    args.model,
                    args.conversations,
                    args.rounds,
                    args.concurrency,
                    args.max_tokens,
                    args.system_repeat,
                    args.user_words,
                    args.think_time,
                    args.seed,
                )
            )
            st["wall"] = time.perf_counter() - t0
            st["requests_done"] = len(st["ttft"])
            st["fleet_hit"], _, st["preemptions"] = fleet_hit_rate(
                before, engine_counters(state["redis_url"], state["model"])
            )
            report(policy, st)
            results[policy] = st
    compare(results)


# -- tool requests: tokenization cost -----------------------------------------------------------
READS_TOOLS = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def bench_tools(n: int) -> list[dict]:
    return [
        {
            "type": "function",
            "function": {
                "name": f"lookup_{i}",
                "description": f"Looks up records of kind {i} in the archive and returns the matches",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "query": {"type": "string", "description": "what to look up"},
                        "limit": {
                            "type": "integer",
                            "minimum": 1,
                            "maximum": 100,
                            "description": "at most this many",
                        },
                        "since": {
                            "type": "string",
                            "format": "date",
                            "description": "only records after this day",
                        },
                    },
                    "required": ["query"],
                },
            },
        }
        for i in range(n)
    ]


def tool_tokenize(args: argparse.Namespace) -> None:
    from kvmesh.common.model_lookup import find_model_dir
    from kvmesh.common.tokenizer import KVMeshTokenizer
    from kvmesh.router.fast_tokenize import FastEncoder
    from kvmesh.router.prompt_tokens import PromptTokens

    messages = [{"role": "user", "content": "Which records of March mention the Oslo office?"}]
    with_tools = {"messages": messages, "tools": bench_tools(args.tools), "tool_choice": "auto"}
    print(
        f"router tokenization of a chat request with {args.tools} tools: p50 of {args.requests} calls "
        "of PromptTokens.tokens_and_keys (ids and block keys), one process"
    )
    for label, template in (
        ("model template (tools in the system prompt)", None),
        ("template reading tools", READS_TOOLS),
    ):
        tok = KVMeshTokenizer(find_model_dir(args.model))
        if template is not None:
            tok.chat_template = template
        prompt_tokens = PromptTokens(FastEncoder(tok), args.model, 16)
        times: dict[str, list[float]] = {"without tools": [], "with tools": []}
        sizes = {}
        for i in range(args.warmup + args.requests):
            for name, req in (
                ("without tools", {"messages": messages}),
                ("with tools", with_tools),
            ):
                t0 = time.perf_counter()
                ids, _ = prompt_tokens.tokens_and_keys("/v1/chat/completions", req, False, False)
                if i >= args.warmup:
                    times[name].append(time.perf_counter() - t0)
                sizes[name] = len(ids)
        before, after = (statistics.median(times[k]) for k in ("without tools", "with tools"))
        print(
            f"  {label}: without tools {before * 1000:.3f} ms ({sizes['without tools']} tokens), "
            f"with tools {after * 1000:.3f} ms ({sizes['with tools']} tokens), ratio {after / before:.1f}x, "
            f"{after / sizes['with tools'] * 1e6:.2f} us/token"
        )
    load = os.getloadavg()[0]
    print(f"  machine: {os.cpu_count()} CPUs, load average {load:.1f} at the end")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    o = sub.add_parser("overhead")
    o.add_argument("--pods", type=int, default=16)
    o.add_argument("--words", type=int, default=675, help="words per prompt (675: ~2,000 tokens)")
    o.add_argument("--requests", type=int, default=300)
    o.add_argument("--warmup", type=int, default=50)
    o.add_argument("--policy", default="prefix")
    o.add_argument("--no-access-log", action="store_true")
    o.add_argument("--min-direct", action="store_true", help="best of two direct runs per request")
    m = sub.add_parser("multiround")
    m.add_argument("--url", default=None, help="an already running mesh (one policy)")
    m.add_argument("--replicas", type=int, default=4)
    m.add_argument("--policies", default="prefix,round-robin")
    m.add_argument("--engine-command", default=None, help="e.g. 'stub' for the stub engine")
    m.add_argument(
        "--engine-args",
        default="",
        help="extra engine flags (with --num-kv-blocks, --cache-fraction does not apply)",
    )
    m.add_argument(
        "--cache-fraction",
        type=float,
        default=0.4,
        help="each replica's KV cache as a fraction of the whole working set",
    )
    m.add_argument("--model", default="smollm2-135m-instruct")
    m.add_argument("--conversations", type=int, default=12)
    m.add_argument("--rounds", type=int, default=6)
    m.add_argument("--concurrency", type=int, default=0, help="cap on requests in flight (0: none)")
    m.add_argument("--max-tokens", type=int, default=48)
    m.add_argument(
        "--system-repeat",
        type=int,
        default=2,
        help="length of the shared system prompt (x ~20 tokens)",
    )
    m.add_argument(
        "--user-words",
        type=int,
        default=50,
        help="words of new text per user turn (~3 tokens each)",
    )
    m.add_argument(
        "--think-time", type=float, default=3.0, help="mean seconds between a user's rounds"
    )
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--verbose", action="store_true")
    t = sub.add_parser("tool-tokenize")
    t.add_argument("--tools", type=int, default=10)
    t.add_argument("--requests", type=int, default=500)
    t.add_argument("--warmup", type=int, default=50)
    t.add_argument("--model", default="smollm2-135m-instruct")
    args = p.parse_args()
    {"overhead": overhead, "multiround": multiround, "tool-tokenize": tool_tokenize}[args.what](
        args
    )


if __name__ == "__main__":
    main()
