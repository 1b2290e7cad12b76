"""The join of the platform's endpoints with Redis heartbeats into the pods the router routes on (pure)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvmesh.common import redis_layout as rl
from kvmesh.common.kv_tiers import BlockCosts
from kvmesh.router.discovery.sources import Endpoint, normalize_url

STATE_NO_HEARTBEAT = "no_heartbeat"  # a known pod with a sidecar whose heartbeat is missing
STATE_UNKNOWN = "unknown"  # a heartbeat state this router does not know (never routed to)
STATE_NOT_READY = "not_ready"  # the platform lists the pod as not ready
STATES = (rl.STATE_READY, rl.STATE_DRAINING, STATE_NO_HEARTBEAT, STATE_NOT_READY, STATE_UNKNOWN)
FALLBACK_REDIS = "redis_unavailable"


@dataclass
class Pod:
    name: str
    url: str
    kv_usage: float = 0.0
    running: int = 0
    waiting: int = 0
    state: str = rl.STATE_READY
    has_blocks: bool = True  # has a Redis block set (a sidecar)
    ts: float = 0.0
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA adapter name -> digest
    active_adapters: tuple[str, ...] = ()  # the adapters of its running batch
    max_loras: int = 0  # adapters one step may hold
    # KV tiers (kvmesh/common/kv_tiers.py): a host tier, the shared tier, its costs per block
    host_tier: bool = False
    shared_tier: bool = False
    costs: BlockCosts | None = None  # None: not reported (the router's defaults)

    @property
    def load(self) -> int:
        return self.running + self.waiting


@dataclass(frozen=True)
class RedisView:
    """The heartbeats last read from Redis (known pods only), when (None: never), and how long
    they may serve once Redis stops answering."""

    heartbeats: Mapping[str, rl.Heartbeat] | None
    read_at: float | None
    stale_after: float


@dataclass(frozen=True)
class JoinState:
    """What one join hands the next: the fallback in force, and the heartbeats it ignored
    ((pod, reason) -> the URL the heartbeat named)."""

    fallback: str | None = None
    ignored: Mapping[tuple[str, str], str] = field(default_factory=dict)


@dataclass(frozen=True)
class FallbackStarted:
    """The Redis view expired: every known pod is routed to by load only."""

    view_age_s: float
    known: int


@dataclass(frozen=True)
class FallbackEnded:
    """Redis answers again: heartbeats and block sets are used again."""


@dataclass(frozen=True)
class IgnoredHeartbeat:
    """A known pod's heartbeat that names another URL, newly seen (counted once, logged)."""

    pod: str
    reason: str
    url: str


Note = FallbackStarted | FallbackEnded | IgnoredHeartbeat


@dataclass(frozen=True)
class Joined:
    pods: dict[str, Pod]
    state: JoinState
    heartbeats: Mapping[str, rl.Heartbeat] | None  # the view kept (None once it expired)
    notes: list[Note]


def join(
    known: list[Endpoint],
    synced: bool,
    view: RedisView | None,
    claims: Mapping[Endpoint, str],
    previous: JoinState,
    now: float,
) -> Joined:
    """The pods from the known endpoints (`synced`: every source has answered) and the Redis view
    (None without Redis); `claims` maps an unnamed static backend to the pod whose heartbeat names
    its URL. The URL is always the platform's; a heartbeat only adds load, state and a block set."""
    fallback, hbs, notes = _fallback(view, previous.fallback, len(known), now)
    named = {e.name: e for e in known if e.name}
    pods: dict[str, Pod] = {}
    ignored: dict[tuple[str, str], str] = {}
    for ep in known:
        if ep.name and ep is not named[ep.name]:
            continue  # a name listed twice (two sources): the last one's URL
        name, hb, mismatch = _match(ep, hbs, claims, named)
        if mismatch is not None and synced:  # before every source has answered, it proves nothing
            ignored[(name, "url_mismatch")] = mismatch
        if name not in pods:
            pods[name] = _pod(name, ep, hb, hbs is None)
    notes += [
        IgnoredHeartbeat(pod, reason, url)
        for (pod, reason), url in ignored.items()
        if (pod, reason) not in previous.ignored
    ]
    return Joined(pods, JoinState(fallback, ignored), hbs, notes)


def state_counts(pods: Mapping[str, Pod]) -> dict[str, int]:
    """state -> pods in it (every state named, zeros included)."""
    counts = dict.fromkeys(STATES, 0)
    for p in pods.values():
        counts[p.state] = counts.get(p.state, 0) + 1
    return counts


def _fallback(
    view: RedisView | None, previous: str | None, known: int, now: float
) -> tuple[str | None, Mapping[str, rl.Heartbeat] | None, list[Note]]:
    """(the fallback, the heartbeats to use, notes). An expired view is dropped: its load and
    block sets are older than a heartbeat's TTL."""
    if view is None:
        return None, None, []
    if view.read_at is None or now - view.read_at > view.stale_after:
        started = previous is None and view.read_at is not None
        return FALLBACK_REDIS, None, [FallbackStarted(now - view.read_at, known)] if started else []
    return None, view.heartbeats, [FallbackEnded()] if previous is not None else []


def _match(
    ep: Endpoint,
    hbs: Mapping[str, rl.Heartbeat] | None,
    claims: Mapping[Endpoint, str],
    named: Mapping[str, Endpoint],
) -> tuple[str, rl.Heartbeat | None, str | None]:
    """(the pod's name, its heartbeat, the URL of a named pod's heartbeat that names another)."""
    if ep.name:
        hb = (hbs or {}).get(ep.name)
        if hb is not None and normalize_url(hb.url) != normalize_url(ep.url):
            return ep.name, None, hb.url
        return ep.name, hb, None
    claim = claims.get(ep)
    hb = (hbs or {}).get(claim) if claim and claim not in named else None
    if hb is None or normalize_url(hb.url) != normalize_url(ep.url):
        return ep.url, None, None
    return claim, hb, None


def _pod(name: str, ep: Endpoint, hb: rl.Heartbeat | None, no_view: bool) -> Pod:
    if hb is not None:
        state = hb.state if hb.state in (rl.STATE_READY, rl.STATE_DRAINING) else STATE_UNKNOWN
        # Numbers from Redis are clamped: a NaN or a negative load must not upset the ranking.
        kv = hb.kv_usage if math.isfinite(hb.kv_usage) else 1.0
        return Pod(
            name=name,
            url=ep.url,
            kv_usage=min(max(kv, 0.0), 1.0),
            running=max(0, hb.running),
            waiting=max(0, hb.waiting),
            state=state if ep.ready else STATE_NOT_READY,
            has_blocks=True,
            ts=hb.ts,
            adapters=hb.adapters,
            active_adapters=hb.active_adapters,
            max_loras=hb.max_loras,
            host_tier=hb.host_blocks > 0,
            shared_tier=hb.shared_tier,
            costs=hb.costs,
        )
    if not ep.ready:
        return Pod(name=name, url=ep.url, state=STATE_NOT_READY, has_blocks=False)
    if (
        no_view or not ep.name
    ):  # no Redis (or an expired view), or an unnamed static backend: by load only
        return Pod(name=name, url=ep.url, has_blocks=False)
    return Pod(name=name, url=ep.url, state=STATE_NO_HEARTBEAT, has_blocks=False)
