"""The heartbeat thread: the engine's readiness and load -> the pod's heartbeat hash in Redis (TTL 10 s).

Every ``heartbeat_interval`` it reads the engine's readiness and ``/metrics`` (engine_probe.py:
our engine's ``/ready``; vLLM's ``/health`` and ``/v1/models``). The state it
publishes is the engine's readiness at that poll, never a latched one: ``ready`` on 200,
``draining`` on 503 (draining, or a restarted engine still loading), ``ready`` again as soon as
the engine is; no heartbeat before the engine is first ready, and ``draining`` for good once this
sidecar shuts down. An unreachable engine has its heartbeat deleted (not routable); a new engine
incarnation (a changed ``process_start_time_seconds``, or a comeback after being unreachable) asks
the events loop for a full resync. Each beat also checks the block set (``IndexWriter.verify``)
and withdraws it while the events loop is dead or stale. An engine serving LoRA adapters has them
in its heartbeat: ``adapters`` (name -> digest, from ``/v1/models``), ``active_adapters`` and
``max_loras`` (from ``vllm:lora_requests_info``). An engine with KV tiers has its costs per
block, its host tier's size and its shared tier in it (kvmesh/common/kv_tiers.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

import httpx
import redis

from kvmesh.common import kv_tiers as kt
from kvmesh.common import redis_layout as rl
from kvmesh.common.engine_load import EngineLoad
from kvmesh.sidecar.adapters import AdapterList
from kvmesh.sidecar.config import SidecarConfig
from kvmesh.sidecar.engine_probe import EngineReading, read_engine
from kvmesh.sidecar.index_writer import F_INDEX, IndexWriter
from kvmesh.sidecar.subscriber import EventsLoop

log = logging.getLogger("kvmesh.sidecar")


class Heartbeat:
    """The heartbeat thread and the engine state it follows."""

    def __init__(self, cfg: SidecarConfig, writer: IndexWriter, events: EventsLoop, stats: Counter):
        self.cfg = cfg
        self.writer = writer
        self.events = events
        self.stats = stats
        self.redis = redis.Redis.from_url(cfg.redis_url, socket_timeout=2, socket_connect_timeout=1)
        self.hb_key = rl.heartbeat_key(cfg.model, cfg.pod_name)
        self.pods_key = rl.pods_key(cfg.model)
        self.state: str | None = None  # None until the engine is first ready
        self.engine_start: float | None = None
        self.engine_failures = 0
        self.engine_problem: str | None = None  # why the engine cannot be read as ready now
        self.last_iteration: float | None = None
        self.adapters = AdapterList(cfg.model)
        self._lora_written = False  # the last hash written has the adapter fields
        self._tier_fields_written: set[str] = set()  # the KV-tier fields the last hash has
        self.thread: threading.Thread | None = None
        self._engine_was_ready = False
        self._shutting_down = False
        self._stop = threading.Event()

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="sidecar-heartbeat", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self.thread is not None:
            self.thread.join(timeout=5)

    def close(self) -> None:
        self.redis.close()

    def problem(self) -> str | None:
        """None unless the thread ended while it was meant to run."""
        t = self.thread
        if t is not None and not t.is_alive() and not self._stop.is_set():
            return "heartbeat loop dead"
        return None

    def mark_draining(self) -> None:
        """This sidecar is shutting down: every heartbeat from now on says `draining`."""
        self._shutting_down = True
        self.state = rl.STATE_DRAINING
        try:
            self.redis.hset(self.hb_key, rl.F_STATE, rl.STATE_DRAINING)
        except redis.RedisError:
            pass

    def _run(self) -> None:
        key = self.cfg.engine_api_key
        client = httpx.Client(
            timeout=httpx.Timeout(2.0, connect=1.0),
            headers={"Authorization": f"Bearer {key}"} if key else None,
        )
        backoff = 0.0
        try:
            while not self._stop.is_set():
                t0 = time.monotonic()
                self.last_iteration = t0
                try:
                    self.beat(client)
                    backoff = 0.0
                except redis.RedisError as exc:
                    self.writer.redis_error(exc)
                    backoff = min(max(backoff * 2, 0.2), self.cfg.max_backoff)
                except Exception:  # noqa: BLE001
                    log.exception("heartbeat failed")
                wait = max(self.cfg.heartbeat_interval - (time.monotonic() - t0), 0.05) + backoff
                self._stop.wait(wait)
        finally:
            client.close()

    def beat(self, client: httpx.Client) -> None:
        """One heartbeat: poll the engine, write the hash, check the block set."""
        cfg = self.cfg
        try:
            reading = read_engine(
                client,
                cfg.engine_url,
                cfg.engine_format,
                cfg.model,
                cfg.block_size,
                self.adapters,
            )
        except httpx.HTTPError as exc:
            self.engine_failures += 1
            if self.engine_failures == self.cfg.engine_down_after:
                log.warning("engine unreachable (%s); withdrawing the heartbeat", exc)
            if self.engine_failures >= self.cfg.engine_down_after:
                self.engine_problem = f"engine {cfg.engine_url} unreachable: {exc}"  # logged above
                self.redis.delete(self.hb_key)
            return
        load = reading.load
        self._check_incarnation(load)
        self.engine_failures = 0
        self._engine_problem(reading.problem)
        self.state = self._state_now(reading.ready)
        if self.state is None:
            return  # never ready yet: no heartbeat, not routable
        problem = self.events.problem()
        if problem is not None:
            self.writer.withdraw(problem, self.redis)
        hb = rl.Heartbeat(
            pod=self.cfg.pod_name,
            url=self.cfg.pod_url,
            model=self.cfg.model,
            state=self.state,
            num_keys=self.writer.num_keys,
        )
        if load:
            hb.kv_usage, hb.running, hb.waiting = load.kv_usage, load.running, load.waiting
            hb.total_blocks = load.total_blocks
            hb.prefix_cache_queries, hb.prefix_cache_hits = (
                load.prefix_cache_queries,
                load.prefix_cache_hits,
            )
            hb.spec_draft_tokens, hb.spec_accepted_tokens = (
                load.spec_draft_tokens,
                load.spec_accepted_tokens,
            )
        _lora_fields(hb, reading)
        _tier_fields(hb, load)
        mapping = hb.to_mapping()
        mapping[rl.F_BLOCK_SIZE] = str(self.cfg.block_size)
        mapping[F_INDEX] = self.writer.index_state
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.hb_key, mapping=mapping)
        if self._lora_written and not hb.max_loras:  # an engine restarted without LoRA
            pipe.hdel(self.hb_key, rl.F_ADAPTERS, rl.F_ACTIVE_ADAPTERS, rl.F_MAX_LORAS)
        # an engine restarted without (some of) its tiers: their fields go
        gone = [f for f in self._tier_fields_written if f not in mapping]
        if gone:
            pipe.hdel(self.hb_key, *gone)
        pipe.expire(self.hb_key, rl.HEARTBEAT_TTL_S)
        pipe.sadd(self.pods_key, self.cfg.pod_name)
        pipe.execute()
        self._lora_written = bool(hb.max_loras)
        self._tier_fields_written = {f for f in TIER_FIELDS if f in mapping}
        self.stats["heartbeats"] += 1
        self.writer.verify(self.redis)

    def _engine_problem(self, problem: str | None) -> None:
        """Keep why the engine cannot be read (the probes' ``engine_problem``); log each new one."""
        if problem is not None and problem != self.engine_problem:
            log.warning("engine not read as ready: %s", problem)
        self.engine_problem = problem

    def _state_now(self, engine_ready: bool) -> str | None:
        """The state this heartbeat publishes: the engine's readiness now, never an earlier one
        (a restarted engine is `draining` while it loads, `ready` again as soon as it is).
        None (no heartbeat) until the engine is first ready; `draining` for good once this
        sidecar is shutting down."""
        if self._shutting_down:
            return rl.STATE_DRAINING
        if engine_ready:
            self._engine_was_ready = True
            return rl.STATE_READY
        return rl.STATE_DRAINING if self._engine_was_ready else None

    def _check_incarnation(self, load: EngineLoad | None) -> None:
        """A restarted engine is a new incarnation: its cache is empty and its KV-event stream
        starts again at seq 0. Seen here as a changed `process_start_time_seconds`, or as an
        engine that answers again after being unreachable (the subscriber also sees the live
        seq going backwards and the socket reconnecting)."""
        start = load.process_start_time if load else None
        if self.engine_failures >= self.cfg.engine_down_after:
            self._engine_restarted("engine came back after being unreachable")
        elif start and self.engine_start and start != self.engine_start:
            self._engine_restarted(
                f"engine process start time changed ({self.engine_start} -> {start})"
            )
        if start:
            self.engine_start = start

    def _engine_restarted(self, reason: str) -> None:
        """Drop the old incarnation's blocks and rebuild from the new one's stream: a reset (the
        events loop rewrites the pod's block set, empty) then a replay from 0 (or a snapshot)."""
        log.info("%s: resyncing the block index", reason)
        self.stats["engine_restarts"] += 1
        self.events.request_resync(reason)


TIER_FIELDS = (kt.F_HOST_BLOCKS, kt.F_SHARED_TIER, *kt.COST_SOURCES.values())


def _tier_fields(hb: rl.Heartbeat, load: EngineLoad | None) -> None:
    """The engine's KV tiers: its costs per block (when it publishes them), its host tier's
    size, whether it has the shared tier (none: the fields stay out of the hash)."""
    if load is None:
        return
    if load.tier_costs:
        hb.costs = kt.BlockCosts.from_mapping(load.tier_costs)
    hb.host_blocks = load.host_blocks
    hb.shared_tier = load.shared_tier


def _lora_fields(hb: rl.Heartbeat, reading: EngineReading) -> None:
    """The adapters an engine serves, its running batch's and its slots per step (none: no LoRA)."""
    load = reading.load
    if load is None or not load.max_loras or reading.adapters is None:
        return
    hb.adapters = reading.adapters
    hb.active_adapters = load.active_adapters
    hb.max_loras = load.max_loras
