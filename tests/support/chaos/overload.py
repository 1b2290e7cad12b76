"""The overload scenario: each admission limit (engine queues, rate limit, hold queue) driven past its capacity."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import httpx

from kvmesh_testing.chaos.load import Load, send_one, words
from kvmesh_testing.chaos.mesh import Mesh, MeshConfig
from kvmesh_testing.chaos.processes import wait_for
from kvmesh_testing.chaos.report import OverloadReport, Part

BULK_KEY = "sk-chaos-bulk"
LIMITED_KEY = "sk-chaos-limited"


@dataclass
class OverloadConfig:
    mesh: MeshConfig = field(
        default_factory=lambda: MeshConfig(
            max_num_seqs=2, max_waiting=2, token_delay=0.02, response_tokens=16, backends="file"
        )
    )
    factor: int = 4  # offered load: this many times each admission limit
    duration_s: float = 8.0  # the engines' queues: at most this long over capacity...
    admitted_target: int = 40  # ... or until this many requests were admitted
    max_requests: int = 3000
    rate_limit_rpm: int = 20  # the limited key's requests per minute at the router
    max_pending: int = 4  # the router's --max-pending-requests (held while no engine is routable)
    deadline: float = 20.0

    def __post_init__(self):
        self.mesh.backends = "file"
        self.mesh.api_keys = [
            f"{BULK_KEY} name=bulk",
            f"{LIMITED_KEY} name=limited rpm={self.rate_limit_rpm}",
        ]
        self.mesh.router_args = [
            *self.mesh.router_args,
            "--max-pending-requests",
            str(self.max_pending),
        ]


async def run_overload(cfg: OverloadConfig) -> OverloadReport:
    rep = OverloadReport()
    t0 = time.monotonic()
    async with Mesh(cfg.mesh) as mesh:
        rep.asgi_tracebacks = await mesh.run_scenario(_overload(mesh, cfg, rep))
    rep.duration_s = time.monotonic() - t0
    return rep


async def _overload(mesh: Mesh, cfg: OverloadConfig, rep: OverloadReport) -> None:
    m = cfg.mesh
    n = len(mesh.engines)
    rep.engine_capacity = m.max_num_seqs + m.max_waiting
    bulk = {"Authorization": f"Bearer {BULK_KEY}"}

    # 1. the engines' queues (max-num-seqs running + max-waiting waiting, each): 429 + Retry-After
    part = Part(
        "engine queues (--max-num-seqs + --max-waiting, each engine)", rep.engine_capacity * n
    )
    part.offered = cfg.factor * part.capacity
    load = Load(
        mesh,
        part.offered,
        deadline=cfg.deadline,
        max_requests=cfg.max_requests,
        headers=bulk,
        backoff_429=0.05,
        prompt_words=20,
        seed=4,
    )
    t = time.monotonic()
    load.start()
    # Bounded in time and in count: until `admitted_target` requests were admitted, at most duration_s.
    deadline = t + cfg.duration_s
    while (
        time.monotonic() < deadline
        and sum(r.status == 200 for r in load.results) < cfg.admitted_target
    ):
        await asyncio.sleep(0.05)
    part.results = await load.stop()
    part.seconds = time.monotonic() - t
    rep.parts.append(part)
    rep.engine_max_admitted = [(await mesh.stats(e))["max_admitted"] for e in mesh.engines]

    # 2. the router's rate limit (rpm per key): factor x a minute's requests, at once
    part = Part("router rate limit (--rate-limit-rpm, per key)", cfg.rate_limit_rpm)
    part.offered = cfg.factor * cfg.rate_limit_rpm
    load = Load(
        mesh,
        min(4, rep.engine_capacity * n),
        deadline=cfg.deadline,
        max_requests=part.offered,
        headers={"Authorization": f"Bearer {LIMITED_KEY}"},
        prompt_words=20,
        seed=5,
    )
    t = time.monotonic()
    load.start()
    await wait_for(lambda: _all_sent(load), cfg.deadline * 2, "the rate-limited key's requests")
    part.results = await load.stop()
    part.seconds = time.monotonic() - t
    rep.parts.append(part)

    # 3. the router's hold queue (no engine routable; --max-pending-requests): 503 + Retry-After
    part = Part(
        "router hold queue (--max-pending-requests, no engine routable)",
        cfg.max_pending,
        refusal=503,
    )
    part.offered = cfg.factor * cfg.max_pending
    mesh.write_backends([])
    await wait_for(lambda: mesh.routable(0), 20, "no routable engine")
    client = httpx.AsyncClient(
        timeout=cfg.deadline, limits=httpx.Limits(max_keepalive_connections=0)
    )
    rng = random.Random(6)
    try:
        t = time.monotonic()
        tasks = [
            asyncio.ensure_future(
                send_one(
                    client,
                    mesh.url + "/v1/completions",
                    {
                        "model": m.model,
                        "prompt": f"held {i}: " + words(rng, 20),
                        "max_tokens": m.response_tokens,
                        "stream": i % 2 == 0,
                    },
                    cfg.deadline,
                    bulk,
                    expected_tokens=m.response_tokens,
                )
            )
            for i in range(part.offered)
        ]
        await wait_for(
            lambda: _held(mesh, cfg.max_pending), cfg.deadline, f"{cfg.max_pending} held requests"
        )
        await wait_for(
            lambda: _n_done(tasks, part.offered - cfg.max_pending),
            cfg.deadline,
            "the requests over the hold queue answered",
        )
        mesh.write_backends(mesh.engines)  # engines appear: the held requests go out
        part.results = list(await asyncio.gather(*tasks))
        part.seconds = time.monotonic() - t
    finally:
        await client.aclose()
    rep.parts.append(part)
    rep.internal_errors = await mesh.metric("kvmesh_router_internal_errors_total")


async def _all_sent(load: Load) -> bool:
    return load.sent >= load.max_requests and len(load.results) >= load.max_requests


async def _held(mesh: Mesh, n: int) -> bool:
    r = await mesh.ready()
    return r is not None and r.get("held_requests") == n


async def _n_done(tasks: list[asyncio.Task], n: int) -> bool:
    return sum(t.done() for t in tasks) >= n
