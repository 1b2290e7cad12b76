"""Contract 3: the Redis key layout shared by sidecar, router, operator and `kvmesh status`.

The one heartbeat type (:class:`Heartbeat`, written by the sidecar) and the one reader
(:func:`read_heartbeats`, used by the router's discovery, the operator's autoscaler, `kvmesh
status` and `kvmesh up --autoscale`, with :class:`PodsSetCursor` for the pods set) live here too.

Anyone who can write Redis can add names to the pods set and hashes under the prefix, so no
reader's work per call may follow what is there: heartbeats are read by name (the pods the
platform lists), and the pods set is walked in bounded pages (SSCAN), never read whole in one
reply, and never with one round trip per name.

Everything lives under a versioned prefix, namespaced by the served model name:

- ``kvmesh:v1:{model}:pods``               set of pod names that have (had) a sidecar
- ``kvmesh:v1:{model}:pod:{pod}``          heartbeat hash, TTL ``HEARTBEAT_TTL_S``, refreshed
                                           every <= 1 s by the pod's sidecar; fields below
- ``kvmesh:v1:{model}:blocks:{pod}``       set of the block keys (``key_hex``) the pod holds
                                           in its KV cache (the GPU tier)
- ``kvmesh:v1:{model}:host-blocks:{pod}``  and ``kvmesh:v1:{model}:shared-blocks``: the KV
                                           tiers' sets (the pod's host tier, the deployment's
                                           shared tier), named in kvmesh/common/kv_tiers.py
- ``kvmesh:v1:{model}:demand``             unix time of the newest request a router holds
                                           because no replica is ready (scale from zero);
                                           TTL ``DEMAND_TTL_S``; the autoscalers read it
- ``kvmesh:v1:{model}:flow:service``       hash tenant -> service (virtual tokens) the routers
                                           gave it, ever: each router adds its part and reads
                                           the fleet's (flow control's fair share)
- ``kvmesh:v1:{model}:flow:queued``        hash router id -> "<requests queued> <unix time>":
                                           the requests waiting at each router (demand)

A pod whose heartbeat hash is gone is dead: it is never routed to, and its block set
(and host set) is deleted (by its sidecar on shutdown or engine restart, or by any router that finds
it orphaned, atomically with ``ORPHAN_CLEANUP_LUA``).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvmesh.common.lora import decode_adapters, encode_adapters

if TYPE_CHECKING:  # kv_tiers imports this module: its names are imported where they are used
    from kvmesh.common.kv_tiers import BlockCosts

PREFIX = "kvmesh:v1:"
HEARTBEAT_TTL_S = 10
HEARTBEAT_INTERVAL_S = 1.0

STATE_READY = "ready"
STATE_DRAINING = "draining"

# Heartbeat hash fields (the operator reads these names).
F_URL = "url"
F_MODEL = "model"
F_KV_USAGE = "kv_usage"
F_RUNNING = "running"
F_WAITING = "waiting"
F_TOTAL_BLOCKS = "total_blocks"
F_STATE = "state"
F_TS = "ts"
# Optional extras written by the kvmesh sidecar (readers must not require them).
F_NUM_KEYS = "num_keys"
F_PREFIX_QUERIES = "prefix_cache_queries"
F_PREFIX_HITS = "prefix_cache_hits"
F_BLOCK_SIZE = "block_size"
F_SPEC_DRAFT = "spec_draft_tokens"  # optional: an engine that speculates (absent: none)
F_SPEC_ACCEPTED = "spec_accepted_tokens"
# LoRA (optional, an engine serving adapters): loaded adapters as JSON name -> digest
# (kvmesh.common.lora.encode_adapters), the adapters of its running batch (comma-separated,
# vLLM's running_lora_adapters) and how many adapters one step may hold (vLLM's max_lora).
F_ADAPTERS = "adapters"
F_ACTIVE_ADAPTERS = "active_adapters"
F_MAX_LORAS = "max_loras"


def pods_key(model: str) -> str:
    return f"{PREFIX}{model}:pods"


def heartbeat_key(model: str, pod: str) -> str:
    return f"{PREFIX}{model}:pod:{pod}"


def blocks_key(model: str, pod: str) -> str:
    return f"{PREFIX}{model}:blocks:{pod}"


DEMAND_TTL_S = 60


def demand_key(model: str) -> str:
    """A router holding requests with no ready replica sets this key to the current
    unix time (TTL ``DEMAND_TTL_S``): the signal to scale a model up from zero."""
    return f"{PREFIX}{model}:demand"


FLOW_TTL_S = 3600  # the flow hashes go once no router has written them for this long
ROUTER_QUEUE_STALE_S = 10.0  # a router's queue depth older than this no longer counts
ROUTER_QUEUE_READ = 128  # router entries read per look (one HSCAN page)


def flow_service_key(model: str) -> str:
    return f"{PREFIX}{model}:flow:service"


def flow_queued_key(model: str) -> str:
    return f"{PREFIX}{model}:flow:queued"


def queued_entry(depth: int, now: float) -> str:
    return f"{int(depth)} {now:.3f}"


def queued_at_routers(entries: Mapping[Any, Any], now: float) -> int:
    """The requests waiting at the routers: the sum of the fresh entries of ``flow:queued``
    (junk and stale entries count nothing)."""
    total = 0
    for raw in entries.values():
        try:
            depth, ts = (raw.decode() if isinstance(raw, bytes) else str(raw)).split()
            depth_n, ts_f = int(depth), float(ts)
        except ValueError:
            continue
        # (a clock a little ahead of the reader's counts too: routers and operator differ)
        if 0 <= depth_n < 1 << 20 and abs(now - ts_f) <= ROUTER_QUEUE_STALE_S:
            total += depth_n
    return total


def read_queued_at_routers(client: Any, model: str, now: float):
    """One bounded page of ``flow:queued``, summed by :func:`queued_at_routers` (with an
    asyncio client, a coroutine of it)."""
    if _is_async(client):
        return _read_queued_async(client, model, now)
    _, entries = client.hscan(flow_queued_key(model), 0, count=ROUTER_QUEUE_READ)
    return queued_at_routers(dict(list(entries.items())[:ROUTER_QUEUE_READ]), now)


async def _read_queued_async(client: Any, model: str, now: float) -> int:
    _, entries = await client.hscan(flow_queued_key(model), 0, count=ROUTER_QUEUE_READ)
    return queued_at_routers(dict(list(entries.items())[:ROUTER_QUEUE_READ]), now)


@dataclass
class Heartbeat:
    """One pod's heartbeat, as written by its sidecar (and read by everyone else).

    `num_keys` (the size of the pod's block set) is optional in the hash: None when absent;
    :attr:`cached_blocks` then estimates it from the KV usage."""

    pod: str
    url: str
    model: str = ""
    kv_usage: float = 0.0
    running: int = 0
    waiting: int = 0
    total_blocks: int = 0
    state: str = STATE_READY
    ts: float = field(default_factory=time.time)
    num_keys: int | None = None
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    spec_draft_tokens: float = 0.0
    spec_accepted_tokens: float = 0.0
    adapters: dict[str, str] = field(default_factory=dict)
    active_adapters: tuple[str, ...] = ()
    max_loras: int = 0
    # KV tiers (kvmesh/common/kv_tiers.py; absent from the hash when off): the engine's costs
    # per block (None: not published), its host tier's size in blocks, a shared tier
    costs: BlockCosts | None = None
    host_blocks: int = 0
    shared_tier: bool = False

    def to_mapping(self) -> dict[str, str]:
        from kvmesh.common import kv_tiers as kt

        out = {
            F_URL: self.url,
            F_MODEL: self.model,
            F_KV_USAGE: f"{self.kv_usage:.6f}",
            F_RUNNING: str(int(self.running)),
            F_WAITING: str(int(self.waiting)),
            F_TOTAL_BLOCKS: str(int(self.total_blocks)),
            F_STATE: self.state,
            F_TS: f"{self.ts:.3f}",
            F_NUM_KEYS: str(int(self.num_keys)) if self.num_keys is not None else None,
            F_PREFIX_QUERIES: f"{self.prefix_cache_queries:g}",
            F_PREFIX_HITS: f"{self.prefix_cache_hits:g}",
            # Only from an engine that speculates: the others' hashes stay as they were.
            F_SPEC_DRAFT: f"{self.spec_draft_tokens:g}" if self.spec_draft_tokens else None,
            F_SPEC_ACCEPTED: f"{self.spec_accepted_tokens:g}" if self.spec_draft_tokens else None,
            # Only from an engine serving adapters.
            F_ADAPTERS: encode_adapters(self.adapters) if self.max_loras else None,
            F_ACTIVE_ADAPTERS: ",".join(self.active_adapters) if self.max_loras else None,
            F_MAX_LORAS: str(int(self.max_loras)) if self.max_loras else None,
            kt.F_HOST_BLOCKS: str(int(self.host_blocks)) if self.host_blocks > 0 else None,
            kt.F_SHARED_TIER: "on" if self.shared_tier else None,
            **(self.costs.to_mapping() if self.costs is not None else {}),
        }
        return {k: v for k, v in out.items() if v is not None}

    @classmethod
    def from_mapping(cls, pod: str, data: Mapping[Any, Any]) -> Heartbeat | None:
        """Parse a heartbeat hash (bytes or str keys); None if it is empty or has no URL."""
        if not data:
            return None
        d = {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in data.items()
        }
        if not d.get(F_URL):
            return None

        def num(name: str, kind=float, default=0):
            try:
                return kind(float(d.get(name, default)))
            except (TypeError, ValueError, OverflowError):
                return kind(default)

        return cls(
            pod=pod,
            url=d[F_URL],
            model=d.get(F_MODEL, ""),
            kv_usage=min(max(num(F_KV_USAGE), 0.0), 1.0),
            running=num(F_RUNNING, int),
            waiting=num(F_WAITING, int),
            total_blocks=num(F_TOTAL_BLOCKS, int),
            state=d.get(F_STATE, STATE_READY),
            ts=num(F_TS),
            num_keys=num(F_NUM_KEYS, int) if d.get(F_NUM_KEYS) not in (None, "") else None,
            prefix_cache_queries=num(F_PREFIX_QUERIES),
            prefix_cache_hits=num(F_PREFIX_HITS),
            spec_draft_tokens=num(F_SPEC_DRAFT),
            spec_accepted_tokens=num(F_SPEC_ACCEPTED),
            adapters=decode_adapters(d.get(F_ADAPTERS)),
            active_adapters=_names(d.get(F_ACTIVE_ADAPTERS)),
            max_loras=max(num(F_MAX_LORAS, int), 0),
            **_tier_fields(d, num),
        )

    @property
    def load(self) -> int:
        return self.running + self.waiting

    @property
    def cached_blocks(self) -> int:
        """Blocks this pod holds: its block-set size, else the used share of its KV cache."""
        return (
            self.num_keys if self.num_keys is not None else round(self.kv_usage * self.total_blocks)
        )

    def fresh(self, now: float, max_age: float = HEARTBEAT_TTL_S) -> bool:
        """Written at most `max_age` seconds before `now` (unix time)."""
        return now - self.ts <= max_age


def _tier_fields(d: Mapping[str, Any], num) -> dict[str, Any]:
    """The KV-tier fields of a heartbeat hash (junk: the defaults, as if absent)."""
    from kvmesh.common import kv_tiers as kt

    return {
        "costs": kt.BlockCosts.from_mapping(d) if kt.F_COST_PREFILL in d else None,
        "host_blocks": min(max(num(kt.F_HOST_BLOCKS, int), 0), 1 << 40),
        "shared_tier": d.get(kt.F_SHARED_TIER) == "on",
    }


def _names(text: str | None, limit: int = 1024) -> tuple[str, ...]:
    """A comma-separated list of adapter names (bounded: it crosses Redis)."""
    return tuple(n for n in (text or "").split(",") if n and len(n) <= 256)[:limit]


# Names of the pods set examined per SSCAN page (COUNT: Redis returns about this many), and
# heartbeats read per pipelined round trip: no single reply grows with what a writer adds.
SCAN_PAGE = 256
READ_BATCH = 512


class PodsSetCursor:
    """Walks one model's pods set in bounded pages (SSCAN), each call resuming where the last
    stopped: a caller that takes one page per cycle does bounded work per cycle however many
    names the set holds, and still visits every name that stays in the set for a whole pass.

    `prefix`: only names that start with it (filtered by Redis, ``MATCH``). With a
    ``redis.Redis``, :meth:`next_page` answers the names; with a ``redis.asyncio.Redis``, an
    awaitable of them. Redis errors are the caller's."""

    def __init__(self, model: str, prefix: str = "", page: int = SCAN_PAGE):
        self.key = pods_key(model)
        self.prefix = prefix
        self.match = _glob_escape(prefix) + "*" if prefix else None
        self.page = max(1, int(page))
        self.cursor = 0
        self.passes = 0  # full passes completed

    @property
    def pass_done(self) -> bool:
        """The last page ended a pass (the next one starts a new pass)."""
        return self.cursor == 0

    def next_page(self, client: Any):
        if _is_async(client):
            return self._next_page_async(client)
        return self._take(client.sscan(self.key, self.cursor, match=self.match, count=self.page))

    async def _next_page_async(self, client: Any) -> list[str]:
        return self._take(
            await client.sscan(self.key, self.cursor, match=self.match, count=self.page)
        )

    def _take(self, reply: Any) -> list[str]:
        cursor, names = reply
        self.cursor = int(cursor)
        if self.cursor == 0:
            self.passes += 1
        return _pod_names(names, self.prefix, False)


def read_heartbeats(
    client: Any,
    model: str,
    pods: Iterable[str] | None = None,
    *,
    prefix: str = "",
    limit: int | None = None,
):
    """The heartbeats of `model`'s pods: pod name -> :class:`Heartbeat`, or None for a pod whose
    hash is gone (expired: the pod is dead or hung) or has no URL.

    `pods`: these names, in this order, in pipelined round trips of ``READ_BATCH`` (what a loop
    should use: the pods the platform lists). Default: one whole pass over the model's pods set
    in ``SCAN_PAGE`` pages (only names starting with `prefix`), sorted; with `limit`, the pass
    stops at the page that reaches it and the first `limit` names of those read are kept. For
    one-off readers: its work follows the set's size. With a ``redis.Redis`` the answer is
    the dict; with a ``redis.asyncio.Redis``, an awaitable of it. Redis errors are the caller's
    to handle. The caller decides what a live heartbeat is (the hash's TTL,
    :meth:`Heartbeat.fresh`, its state)."""
    if _is_async(client):
        return _read_heartbeats_async(client, model, pods, prefix, limit)
    if pods is None:
        cursor, found = PodsSetCursor(model, prefix), set()
        while True:
            found.update(cursor.next_page(client))
            if cursor.pass_done or (limit is not None and len(found) >= limit):
                break
        names = _limited(found, limit)
    else:
        names = _pod_names(pods, "", False)
    out: dict[str, Heartbeat | None] = {}
    for i in range(0, len(names), READ_BATCH):
        pipe = client.pipeline(transaction=False)
        for name in names[i : i + READ_BATCH]:
            pipe.hgetall(heartbeat_key(model, name))
        out.update(_parse_heartbeats(names[i : i + READ_BATCH], pipe.execute()))
    return out


async def _read_heartbeats_async(
    client: Any, model: str, pods: Iterable[str] | None, prefix: str, limit: int | None
) -> dict[str, Heartbeat | None]:
    if pods is None:
        cursor, found = PodsSetCursor(model, prefix), set()
        while True:
            found.update(await cursor.next_page(client))
            if cursor.pass_done or (limit is not None and len(found) >= limit):
                break
        names = _limited(found, limit)
    else:
        names = _pod_names(pods, "", False)
    out: dict[str, Heartbeat | None] = {}
    for i in range(0, len(names), READ_BATCH):
        pipe = client.pipeline(transaction=False)
        for name in names[i : i + READ_BATCH]:
            pipe.hgetall(heartbeat_key(model, name))
        out.update(_parse_heartbeats(names[i : i + READ_BATCH], await pipe.execute()))
    return out


def _is_async(client: Any) -> bool:
    return inspect.iscoroutinefunction(getattr(client, "execute_command", None))


def _limited(names: Iterable[str], limit: int | None) -> list[str]:
    return sorted(names)[:limit] if limit is not None else sorted(names)


def _glob_escape(text: str) -> str:
    """`text` as a literal in a Redis glob pattern (MATCH)."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _pod_names(raw: Iterable[Any], prefix: str, sort: bool) -> list[str]:
    names = [n.decode(errors="replace") if isinstance(n, bytes) else str(n) for n in raw]
    names = [n for n in names if n.startswith(prefix)]
    return sorted(names) if sort else names


def _parse_heartbeats(names: list[str], hashes: list[Any]) -> dict[str, Heartbeat | None]:
    return {name: Heartbeat.from_mapping(name, data) for name, data in zip(names, hashes)}


# KEYS: heartbeat key, blocks key, pods set, and optionally the pod's host-blocks key; ARGV:
# pod name. Deletes a pod's block set (and host set) and membership only if its heartbeat is
# (still) gone, so a router never races a sidecar that just came back.
ORPHAN_CLEANUP_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('DEL', KEYS[2])
  if KEYS[4] then redis.call('DEL', KEYS[4]) end
  redis.call('SREM', KEYS[3], ARGV[1])
  return 1
end
return 0
"""

# KEYS[1]: the pods set, then per name in ARGV its heartbeat key, its block-set key and its
# host-blocks key. One page of the pods set in one command: per name, the URL its heartbeat
# names ("" if none), or 0 if its heartbeat is gone, in which case its block and host sets and
# membership are deleted (an orphan, as in ORPHAN_CLEANUP_LUA; atomic, so a sidecar that just
# came back is never touched). Nothing else of a pod is read: a reader ignores names it does
# not know before reading more.
POD_PAGE_LUA = """
local out = {}
for i, name in ipairs(ARGV) do
  local hb = KEYS[3 * i - 1]
  if redis.call('EXISTS', hb) == 1 then
    out[i] = redis.call('HGET', hb, 'url') or ''
  else
    redis.call('DEL', KEYS[3 * i], KEYS[3 * i + 1])
    redis.call('SREM', KEYS[1], name)
    out[i] = 0
  end
end
return out
"""

# KEYS: one block-set key per pod; ARGV[1]: the request's block keys (key_hex, 16 chars
# each) concatenated in order. Returns, per pod, the length of the longest leading run
# of those keys present in its set. One round trip for all pods; it stops at the first
# miss, so its cost follows the matched length. (One packed argument instead of one per
# key keeps the client's command encoding cheap for long prompts.)
PREFIX_MATCH_LUA = """
local packed = ARGV[1]
local n = math.floor(#packed / 16)
local keys = {}
for j = 1, n do keys[j] = string.sub(packed, (j - 1) * 16 + 1, j * 16) end
local out = {}
for i, k in ipairs(KEYS) do
  local m = 0
  for j = 1, n do
    if redis.call('SISMEMBER', k, keys[j]) == 1 then m = j else break end
  end
  out[i] = m
end
return out
"""

# The same match with the KV tiers (kvmesh/common/kv_tiers.py). KEYS[1]: the shared-blocks
# sorted set, then per pod its block-set key and its host-blocks key; ARGV[1]: the packed block
# keys as above; ARGV[2]: one digit per pod, 1 if it has a host tier plus 2 if it reads the
# shared tier. Returns per pod three counts (g, c, s): the leading run in its block set, then
# block by block in its host set, else in the shared set, up to the first miss. A pod without
# tiers costs what it costs in PREFIX_MATCH_LUA; a tier key of the wrong type counts as empty.
PREFIX_MATCH_TIERS_LUA = """
local packed, tiers = ARGV[1], ARGV[2] or ''
local n = math.floor(#packed / 16)
local keys = {}
for j = 1, n do keys[j] = string.sub(packed, (j - 1) * 16 + 1, j * 16) end
local shared = KEYS[1]
local shared_ok = string.find(tiers, '[23]') ~= nil and redis.call('TYPE', shared).ok == 'zset'
local out = {}
for i = 1, math.floor((#KEYS - 1) / 2) do
  local f = tonumber(string.sub(tiers, i, i)) or 0
  local gk, hk = KEYS[2 * i], KEYS[2 * i + 1]
  local g, c, s = 0, 0, 0
  for j = 1, n do
    if redis.call('SISMEMBER', gk, keys[j]) == 1 then g = j else break end
  end
  local host = f % 2 == 1 and g < n and redis.call('TYPE', hk).ok == 'set'
  local sh = f >= 2 and shared_ok
  if host or sh then
    for j = g + 1, n do
      if host and redis.call('SISMEMBER', hk, keys[j]) == 1 then
        c = c + 1
      elseif sh and redis.call('ZSCORE', shared, keys[j]) then
        s = s + 1
      else
        break
      end
    end
  end
  out[3 * i - 2], out[3 * i - 1], out[3 * i] = g, c, s
end
return out
"""


def leading_run(flags: list[Any]) -> int:
    """Length of the leading run of truthy SMISMEMBER results."""
    n = 0
    for f in flags:
        if not f:
            break
        n += 1
    return n


def reconnecting_retry():
    """redis-py's retry policy for the long-lived async clients (router, operator). After Redis
    restarts or fails over, every pooled connection is dead and the first call on each would
    fail (the router would pause its block sets, the operator skip a scaling tick): a connection
    error is retried once, at once, on a new connection. A timeout is not retried: a Redis that
    does not answer costs a caller one timeout, not two."""
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError

    return Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
