"""`kvmesh status`: the replicas a mesh has in Redis, their load and prefix-cache hit rates."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--redis-url",
        default=os.environ.get("KVMESH_REDIS_URL"),
        help="default: the mesh started by `kvmesh up`, else redis://127.0.0.1:6379/0",
    )
    p.add_argument("--model", default=None, help="only this served model (default: all)")
    p.add_argument("--state-file", default=None)
    p.add_argument("--json", action="store_true")


MAX_PODS = (
    10_000  # pods shown per model: a set stuffed with junk names cannot make this run forever
)


def collect(redis_url: str, model: str | None = None, max_pods: int = MAX_PODS) -> list[dict]:
    """One row per pod name in each model's pods set (read in pages, heartbeats and block-set
    sizes in pipelined batches: no round trip per pod), at most `max_pods` per model."""
    import redis

    from kvmesh.common import redis_layout as rl

    r = redis.Redis.from_url(
        redis_url, socket_timeout=2, socket_connect_timeout=2, decode_responses=True
    )
    if model:
        models = [model]
    else:
        models = sorted(
            k[len(rl.PREFIX) : -len(":pods")]
            for k in r.scan_iter(match=f"{rl.PREFIX}*:pods", count=1000, _type="set")
        )
    rows = []
    for m in models:
        beats = rl.read_heartbeats(r, m, limit=max_pods)
        total = r.scard(rl.pods_key(m))
        if total > len(beats):
            print(
                f"kvmesh status: {m}: showing {len(beats)} of the {total} pod names in Redis",
                file=sys.stderr,
            )
        names = list(beats)
        sizes: list[int] = []
        for i in range(0, len(names), rl.READ_BATCH):
            pipe = r.pipeline(transaction=False)
            for pod in names[i : i + rl.READ_BATCH]:
                pipe.scard(rl.blocks_key(m, pod))
            sizes += pipe.execute()
        for (pod, hb), keys in zip(beats.items(), sizes):
            if hb is None:
                rows.append({"model": m, "pod": pod, "state": "gone", "blocks_indexed": keys})
                continue
            hit = (
                hb.prefix_cache_hits / hb.prefix_cache_queries if hb.prefix_cache_queries else None
            )
            accept = (
                hb.spec_accepted_tokens / hb.spec_draft_tokens if hb.spec_draft_tokens else None
            )
            rows.append(
                {
                    "model": m,
                    "pod": pod,
                    "state": hb.state,
                    "url": hb.url,
                    "kv_usage": hb.kv_usage,
                    "running": hb.running,
                    "waiting": hb.waiting,
                    "total_blocks": hb.total_blocks,
                    "blocks_indexed": keys,
                    "prefix_hit_rate": hit,
                    "spec_acceptance_rate": accept,
                    "age_s": round(time.time() - hb.ts, 1),
                }
            )
    return rows


def run(args: argparse.Namespace) -> int:
    import redis

    from kvmesh.common.logging_setup import redact_url
    from kvmesh.mesh.up import default_state_file

    url, model = args.redis_url, args.model
    state_path = args.state_file or str(default_state_file())
    router_url = None
    if not url and os.path.exists(state_path):
        state = json.loads(open(state_path).read())
        url, router_url = state.get("redis_url"), state.get("router_url")
        model = model or state.get("model")
    url = url or "redis://127.0.0.1:6379/0"
    try:
        rows = collect(url, model)
    except redis.RedisError as exc:
        print(f"kvmesh status: cannot reach Redis at {redact_url(url)}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(
            json.dumps(
                {"redis_url": redact_url(url), "router_url": router_url, "replicas": rows}, indent=2
            )
        )
        return 0
    if router_url:
        print(f"router  {router_url}")
    print(f"redis   {redact_url(url)}")
    if not rows:
        print("no replicas registered")
        return 0
    header = (
        "MODEL",
        "REPLICA",
        "STATE",
        "KV USE",
        "RUNNING",
        "WAITING",
        "BLOCKS",
        "HIT RATE",
        "SPEC ACCEPT",
        "URL",
    )
    table = [header]
    for r in rows:
        hit = r.get("prefix_hit_rate")
        accept = r.get("spec_acceptance_rate")
        table.append(
            (
                r["model"],
                r["pod"],
                r["state"],
                f"{r['kv_usage']:.0%}" if "kv_usage" in r else "-",
                str(r.get("running", "-")),
                str(r.get("waiting", "-")),
                f"{r['blocks_indexed']}/{r.get('total_blocks', '-')}",
                f"{hit:.0%}" if hit is not None else "-",
                f"{accept:.0%}" if accept is not None else "-",
                r.get("url", "-"),
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0
