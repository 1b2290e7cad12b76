"""Adapters at runtime: each ready replica loads the spec's adapters and unloads the others
through its engine's vLLM-compatible API, and the status says where each adapter stands.

What a replica serves comes from its heartbeat's ``adapters`` field (the sidecar reads it off
the engine's ``/v1/models``); what this module asked for it is remembered per pod, so an
adapter whose load was answered is not loaded again before a heartbeat could show it. A
heartbeat newer than that still without it (the engine restarted, say) loads it again.
"""

from __future__ import annotations

import asyncio
import base64
import posixpath
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import kopf

from kvmesh.operator import adapters as lora
from kvmesh.operator import crd, render, scaling
from kvmesh.operator.memo import Memo
from kvmesh.operator.status_write import write_status

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
LOADED, LOADING, FETCHING, FAILED = "loaded", "loading", "fetching", "failed"
LOAD_FAILED = "AdapterLoadFailed"


@dataclass
class PodMemory:
    """What the operator asked of one replica, until its heartbeat shows the outcome."""

    loaded: dict[str, float] = field(default_factory=dict)  # adapter -> when a load succeeded
    unloaded: dict[str, float] = field(default_factory=dict)
    failed: dict[str, tuple[str, float]] = field(default_factory=dict)  # -> (reason, when)


@dataclass
class SyncState:
    pods: dict[str, PodMemory] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def _reason(status: int, body: Any, text: str) -> str:
    """The error message of a vLLM-style answer ({"error": {"message"}} or {"message"})."""
    if isinstance(body, dict):
        err = body.get("error")
        message = err.get("message") if isinstance(err, dict) else body.get("message") or err
        if message:
            return f"HTTP {status}: {message}"[:500]
    return f"HTTP {status}: {text.strip()}"[:500]


async def _post(
    http: aiohttp.ClientSession, url: str, payload: dict[str, str], key: str | None
) -> tuple[int, str]:
    """(status, reason) of one POST; status 0 when the engine could not be reached."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        async with http.post(url, json=payload, headers=headers) as resp:
            text = await resp.text()
            try:
                body = await resp.json(content_type=None)
            except ValueError:
                body = None
            return resp.status, _reason(resp.status, body, text)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return 0, f"engine unreachable: {exc!r}"[:500]


async def load(
    http: aiohttp.ClientSession, base: str, adapter: lora.Adapter, key: str | None
) -> str | None:
    """Load one adapter on one engine: None when it serves it, else the reason."""
    payload = {"lora_name": adapter.name, "lora_path": adapter.path}
    status, reason = await _post(http, base.rstrip("/") + LOAD, payload, key)
    if status == 200 or (status == 400 and "already" in reason.lower()):
        return None
    return reason


async def unload(http: aiohttp.ClientSession, base: str, name: str, key: str | None) -> str | None:
    status, reason = await _post(http, base.rstrip("/") + UNLOAD, {"lora_name": name}, key)
    if status in (200, 404) or (status == 400 and "not" in reason.lower()):
        return None  # unloaded, or not there
    return reason


async def _api_key(memo: Memo, md: dict[str, Any], spec: dict[str, Any]) -> str | None:
    if not spec["engine"].get("requireApiKey", True):
        return None
    assert memo.client is not None
    meta = md["metadata"]
    secret = await memo.client.get(
        "Secret", meta["namespace"], render.names(meta["name"])["engine-api-key"]
    )
    raw = ((secret or {}).get("data") or {}).get("api-key")
    return base64.b64decode(raw).decode() if raw else None


async def _fetched(memo: Memo, md: dict[str, Any], spec: dict[str, Any]) -> set[str]:
    """Hugging Face adapters whose fetch Job has succeeded (found by the directory it fills)."""
    wanted = [a for a in lora.adapters(spec) if a.from_hugging_face]
    if not wanted:
        return set()
    assert memo.client is not None
    meta = md["metadata"]
    jobs = await memo.client.list("Job", meta["namespace"], f"{render.LABEL_MD}={meta['name']}")
    done = {
        (j["metadata"].get("labels") or {}).get(render.LABEL_ADAPTER_DIR)
        for j in jobs
        if int((j.get("status") or {}).get("succeeded") or 0)
    }
    return {a.name for a in wanted if posixpath.basename(a.path) in done}


@dataclass
class Replica:
    """One ready replica: its pod, its engine's URL and its heartbeat's view."""

    pod: str
    url: str
    ts: float
    serves: set[str]


class Syncer:
    """One pass over the ready replicas of one ModelDeployment."""

    def __init__(self, memo: Memo, md: dict[str, Any], state: SyncState, logger: Any) -> None:
        self.memo, self.md, self.state, self.logger = memo, md, state, logger
        self.settle = memo.config.adapter_settle_seconds
        self.retry = memo.config.adapter_retry_seconds

    async def ensure(
        self, http: aiohttp.ClientSession, rep: Replica, adapter: lora.Adapter, key: str | None
    ) -> tuple[str, str]:
        """(state, reason) of one adapter on one replica, loading it if it must be."""
        mem = self.state.pods.setdefault(rep.pod, PodMemory())
        if adapter.name in rep.serves:
            mem.loaded.pop(adapter.name, None)
            mem.failed.pop(adapter.name, None)
            return LOADED, ""
        asked = mem.loaded.get(adapter.name)
        if asked is not None and rep.ts < asked + self.settle:
            return LOADING, ""  # answered; the heartbeat has not caught up yet
        now = time.time()
        failed = mem.failed.get(adapter.name)
        if failed is not None and now < failed[1] + self.retry:
            return FAILED, failed[0]
        reason = await load(http, rep.url, adapter, key)
        if reason is None:
            mem.loaded[adapter.name] = time.time()
            mem.failed.pop(adapter.name, None)
            return LOADING, ""
        if failed is None:
            kopf.warn(
                crd.object_ref(self.md),
                reason=LOAD_FAILED,
                message=f"adapter {adapter.name} on {rep.pod}: {reason}",
            )
        mem.failed[adapter.name] = (reason, time.time())
        return FAILED, reason

    async def remove(
        self, http: aiohttp.ClientSession, rep: Replica, name: str, key: str | None
    ) -> None:
        mem = self.state.pods.setdefault(rep.pod, PodMemory())
        asked = mem.unloaded.get(name)
        if asked is not None and rep.ts < asked + self.settle:
            return
        reason = await unload(http, rep.url, name, key)
        if reason is None:
            mem.unloaded[name] = time.time()
        else:
            self.logger.warning(f"unloading adapter {name} from {rep.pod} failed: {reason}")


async def _replicas(memo: Memo, md: dict[str, Any], spec: dict[str, Any], logger: Any):
    """The ready replicas with a live heartbeat; None when Redis could not be read."""
    meta = md["metadata"]
    pods = await scaling.engine_pods(memo, meta["namespace"], meta["name"])
    load_ = await scaling.read_load(memo, md, spec, logger, pods)
    if not load_.known:
        return None
    if pods is None:
        logger.warning("cannot list engine pods: adapters are not loaded (grant pods list)")
        return None
    replicas = []
    for pod in pods:
        beat = load_.heartbeats.get(pod.name)
        if not pod.ready or beat is None:
            continue
        # The URL comes from Redis, which more parties can write than the API: the operator
        # sends the engine API key only to the address the API server gives the pod.
        if not pod.ip or urlsplit(beat.url).hostname != pod.ip:
            logger.warning(f"{pod.name}: heartbeat URL {beat.url[:100]!r} is not the pod's IP")
            continue
        replicas.append(Replica(beat.pod, beat.url, beat.ts, set(beat.adapters)))
    return replicas


async def sync(memo: Memo, md: dict[str, Any], spec: dict[str, Any], logger: Any) -> None:
    """Load and unload adapters on the ready replicas to match the spec; write the status.
    One pass at a time per ModelDeployment (the spec handler and the repair loop)."""
    state = memo.adapters.setdefault(md["metadata"]["uid"], SyncState())
    async with state.lock:
        await _sync(memo, md, spec, state, logger)


async def _sync(
    memo: Memo, md: dict[str, Any], spec: dict[str, Any], state: SyncState, logger: Any
) -> None:
    old = md.get("status") or {}
    if not lora.enabled(spec):
        if "adapters" in old or "adaptersReady" in old:
            await write_status(memo, md, {"adapters": None, "adaptersReady": None})
        return
    replicas = await _replicas(memo, md, spec, logger)
    if replicas is None:
        return
    desired = lora.adapters(spec)
    fetched, key = await _fetched(memo, md, spec), await _api_key(memo, md, spec)
    syncer = Syncer(memo, md, state, logger)
    seen: dict[str, dict[str, tuple[str, str]]] = {a.name: {} for a in desired}
    timeout = aiohttp.ClientTimeout(total=memo.config.adapter_load_timeout)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        for rep in replicas:
            for a in desired:
                if a.from_hugging_face and a.name not in fetched and a.name not in rep.serves:
                    seen[a.name][rep.pod] = (FETCHING, "")
                else:
                    seen[a.name][rep.pod] = await syncer.ensure(http, rep, a, key)
            for name in sorted(rep.serves - set(seen)):
                await syncer.remove(http, rep, name, key)
    for pod in set(state.pods) - {r.pod for r in replicas}:
        del state.pods[pod]  # gone or not ready: a new start reads the whole list
    patch = status_patch([a.name for a in desired], seen, len(replicas))
    if {k: old.get(k) for k in patch} != patch:
        await write_status(memo, md, patch)


def _overall(states: list[str], replicas: int) -> str:
    if FAILED in states:
        return "Failed"
    if replicas and all(s == LOADED for s in states):
        return "Loaded"
    return "Fetching" if FETCHING in states else "Loading"


def status_patch(
    names: list[str], seen: dict[str, dict[str, tuple[str, str]]], replicas: int
) -> dict[str, Any]:
    """status.adapters (per adapter, per ready replica) and status.adaptersReady ("n/total")."""
    out = []
    for name in names:
        per_pod = seen.get(name, {})
        rows = [
            {"pod": pod, "state": s, **({"reason": r} if r else {})}
            for pod, (s, r) in sorted(per_pod.items())
        ]
        states = [s for s, _ in per_pod.values()]
        out.append(
            {
                "name": name,
                "state": _overall(states, replicas),
                "loadedReplicas": states.count(LOADED),
                "replicas": rows,
            }
        )
    ready = sum(a["state"] == "Loaded" for a in out)
    return {"adapters": out, "adaptersReady": f"{ready}/{len(names)}"}
