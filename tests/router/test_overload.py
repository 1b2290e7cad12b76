"""Overload on loopback: each admission limit of the mesh driven at 4x its
capacity for a bounded time; the answer is only ever a 429 with Retry-After (the engines' queues,
`--max-num-seqs` + `--max-waiting`; the router's per-key `--rate-limit-rpm`), or the documented
503 with Retry-After (the router's hold queue, `--max-pending-requests`, while no engine is
routable); never another 5xx; every admitted request completes. The scenario is
tests/support/chaos/overload.py (bench/chaos.py runs it larger)."""

from __future__ import annotations

import asyncio
import math

from kvmesh_testing.chaos import MeshConfig, OverloadConfig, run_overload


def test_four_times_each_admission_limit_gets_only_retry_after_refusals_and_admitted_requests_complete():
    cfg = OverloadConfig(
        mesh=MeshConfig(
            engines=2, max_num_seqs=2, max_waiting=2, token_delay=0.02, response_tokens=16
        ),
        factor=4,
        duration_s=8.0,
        admitted_target=40,
        rate_limit_rpm=20,
        max_pending=4,
    )
    rep = asyncio.run(run_overload(cfg))
    print("\n".join(rep.lines()))
    assert [p.name.split(" (")[0] for p in rep.parts] == [
        "engine queues",
        "router rate limit",
        "router hold queue",
    ]

    for p in rep.parts:
        assert p.offered == 4 * p.capacity, p.name
        assert p.results, p.name
        assert [r.short() for r in p.server_errors] == [], (
            p.name
        )  # no 5xx (other than the documented 503)
        assert [r.short() for r in p.refused_without_retry_after] == [], p.name
        assert [r.short() for r in p.incomplete] == [], p.name  # every admitted request completes
        assert p.admitted and p.refused, p.line()

    # The engines' queues: the engines never hold more than they admit; their 429s reach the
    # client as they are (after the router tried the other engine).
    engines = rep.part("engine queues")
    assert len(engines.admitted) >= cfg.admitted_target or engines.seconds >= cfg.duration_s
    assert all(r.error["code"] == "queue_full" for r in engines.refused)
    assert max(rep.engine_max_admitted) <= rep.engine_capacity
    assert max(rep.engine_max_admitted) == rep.engine_capacity  # driven to the limit

    # The router's rate limit: a minute's budget (plus what refills meanwhile) is admitted.
    limited = rep.part("router rate limit")
    assert len(limited.results) == 4 * cfg.rate_limit_rpm
    refill = math.ceil(limited.seconds * cfg.rate_limit_rpm / 60)
    assert cfg.rate_limit_rpm <= len(limited.admitted) <= cfg.rate_limit_rpm + refill + 1
    assert all(r.error["code"] == "rate_limit_exceeded" for r in limited.refused)

    # The hold queue: max_pending requests wait for an engine and then complete; the rest get
    # 503 + Retry-After at once.
    held = rep.part("router hold queue")
    assert len(held.admitted) == cfg.max_pending
    assert len(held.refused) == 3 * cfg.max_pending
    assert all(r.error["code"] == "no_ready_engine" and r.retry_after == "5" for r in held.refused)

    assert rep.internal_errors == 0 and rep.asgi_tracebacks == 0
    assert rep.problems() == []
