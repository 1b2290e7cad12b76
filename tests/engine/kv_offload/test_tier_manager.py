"""The KV-cache manager with a host tier: copy-on-evict, lookups past the cache, the step's
transfers, events (which keys, parents, token ids, media) and the tier-off baseline."""

from __future__ import annotations

from kvmesh.common.kv_events import BlockRemoved, BlockStored
from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.kv_offload.host_pool import HostEntry
from kvmesh.engine.kv_offload.tiers import KVTiers
from kvmesh.engine.kv_offload.transfer import KVLoad, KVStore
from kvmesh.engine.request import Request
from kvmesh.engine.sampling_params import SamplingParams

BS = 2


def request(rid, tokens, prompt_logprobs=None):
    params = SamplingParams(max_tokens=4, prompt_logprobs=prompt_logprobs)
    return Request(rid, tokens, params, set(), "m", BS, 64)


def admit(kv: KVCacheManager, req: Request) -> int:
    hits, num_computed = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_computed, hits) is not None
    req.num_computed_tokens = num_computed
    if req.num_cached_tokens < 0:
        req.num_cached_tokens = num_computed
    return num_computed


def run(tiers: KVTiers | None):
    """A's two full blocks are cached, then evicted by B; A comes back."""
    kv = KVCacheManager(4, BS, enable_events=True, tiers=tiers)
    a = request("a", [1, 2, 3, 4, 5])
    admit(kv, a)
    kv.free(a)
    b = request("b", [9, 9, 8, 8, 7, 7, 6])
    admit(kv, b)  # 4 blocks: A's cached blocks are evicted
    kv.free(b)
    again = request("a2", [1, 2, 3, 4, 6])
    return kv, a, again, admit(kv, again)


def test_evicted_blocks_go_to_the_host_tier_with_self_describing_events():
    tiers = KVTiers(BS, host_blocks=8)
    kv, a, again, num_computed = run(tiers)
    k1, k2 = a.block_keys(2)
    events = kv.take_events()
    cpu = [e for e in events if getattr(e, "medium", None) == "CPU"]
    # evicted tail first (a request's blocks are freed tail first), each event whole
    assert cpu[:2] == [
        BlockStored([k2], k1, [3, 4], BS, medium="CPU"),
        BlockStored([k1], None, [1, 2], BS, medium="CPU"),
    ]
    # the reload: both blocks come from the host tier, registered in the KV cache again
    assert num_computed == 4
    assert again.num_cached_tokens_by_medium == {"GPU": 0, "CPU": 4, "SHARED": 0}
    assert BlockStored([k1, k2], None, [1, 2, 3, 4], BS, medium="GPU") in events[-3:]


def test_the_step_copies_stores_then_loads_into_the_right_blocks():
    tiers = KVTiers(BS, host_blocks=8)
    kv = KVCacheManager(4, BS, tiers=tiers)
    a = request("a", [1, 2, 3, 4, 5])
    admit(kv, a)
    a_blocks = kv.block_table("a")[:2]
    kv.free(a)
    b = request("b", [9, 9, 8, 8, 7, 7, 6])
    admit(kv, b)
    t = kv.take_transfers()
    assert sorted(s.gpu_block for s in t.stores) == sorted(a_blocks)
    assert t.loads == []
    slots = {s.gpu_block: s.host_slot for s in t.stores}
    kv.free(b)
    again = request("a2", [1, 2, 3, 4, 6])
    admit(kv, again)
    t = kv.take_transfers()
    table = kv.block_table("a2")
    assert t.loads == [
        KVLoad(table[0], slots[a_blocks[0]]),
        KVLoad(table[1], slots[a_blocks[1]]),
    ]
    # B's blocks were evicted to make room: stored too, before the loads read anything
    assert all(isinstance(s, KVStore) for s in t.stores)
    assert not {s.host_slot for s in t.stores} & {ld.host_slot for ld in t.loads}


def test_gpu_events_are_the_same_with_the_tier_off():
    off, *_ = run(None)
    on, *_ = run(KVTiers(BS, host_blocks=8))
    gpu_on = [e for e in on.take_events() if getattr(e, "medium", None) != "CPU"]
    events_off = off.take_events()
    assert all(getattr(e, "medium", None) != "CPU" for e in events_off)
    # the tier's reload is the difference: off, A's prefix is prefilled again, same blocks
    assert [type(e) for e in gpu_on] == [type(e) for e in events_off]
    assert [e.block_hashes for e in gpu_on] == [e.block_hashes for e in events_off]


def test_a_full_host_tier_evicts_its_oldest_block_with_a_cpu_event():
    kv, a, again, num_computed = run(KVTiers(BS, host_blocks=1))
    k1, k2 = a.block_keys(2)
    events = [e for e in kv.take_events() if getattr(e, "medium", None) == "CPU"]
    assert events[:3] == [
        BlockStored([k2], k1, [3, 4], BS, medium="CPU"),
        BlockRemoved([k2], medium="CPU"),
        BlockStored([k1], None, [1, 2], BS, medium="CPU"),
    ]
    # the reload's lookup pinned k1: B's blocks, evicted by that reload, could not take its slot
    assert num_computed == 2
    assert again.num_cached_tokens_by_medium == {"GPU": 0, "CPU": 2, "SHARED": 0}
    assert len(events) == 3


def test_a_lookup_stops_at_the_first_block_no_tier_holds():
    tiers = KVTiers(BS, host_blocks=8)
    kv = KVCacheManager(4, BS, tiers=tiers)
    req = request("c", [1, 2, 3, 4, 5])
    k1, k2 = req.block_keys(2)
    tiers.host.put(k2, lambda slot: HostEntry(slot, k1, (3, 4), BS))  # the second block only
    assert kv.get_computed_blocks(req) == ([], 0)
    tiers.host.put(k1, lambda slot: HostEntry(slot, None, (1, 2), BS))
    assert kv.get_computed_blocks(req) == ([], 4)


def test_prompt_logprobs_skip_every_tier():
    tiers = KVTiers(BS, host_blocks=8)
    kv, *_ = run(tiers)
    req = request("p", [1, 2, 3, 4, 7], prompt_logprobs=1)
    assert kv.get_computed_blocks(req) == ([], 0)


def test_a_shared_store_is_read_after_the_host_tier():
    class Store:
        def __init__(self):
            self.reads = []

        def contains(self, key):
            return True

        def read(self, key):
            self.reads.append(key)
            return b"payload"

    tiers = KVTiers(BS, host_blocks=0, shared=Store())
    kv = KVCacheManager(4, BS, tiers=tiers)
    req = request("s", [1, 2, 3, 4, 5])
    assert admit(kv, req) == 4
    assert tiers.shared.reads == req.block_keys(2)
    assert [ld.payload for ld in kv.take_transfers().loads] == [b"payload", b"payload"]
    assert req.num_cached_tokens_by_medium == {"GPU": 0, "CPU": 0, "SHARED": 4}


def test_reset_clears_the_host_tier():
    tiers = KVTiers(BS, host_blocks=8)
    kv, a, again, _ = run(tiers)
    kv.free(again)
    assert len(tiers.host) > 0
    assert kv.reset_prefix_cache()
    assert len(tiers.host) == 0


def test_cpu_events_carry_the_adapter_and_its_keys_chain_from_its_root():
    class Adapter:
        name, int_id, digest = "sql", 7, "d1"

    tiers = KVTiers(BS, host_blocks=8)
    kv = KVCacheManager(2, BS, enable_events=True, tiers=tiers)
    params = SamplingParams(max_tokens=4)
    a = Request("a", [1, 2, 3], params, set(), "m", BS, 64, lora=Adapter())
    admit(kv, a)
    kv.free(a)
    admit(kv, request("b", [5, 6, 7]))  # evicts the adapter's block
    (stored,) = [e for e in kv.take_events() if getattr(e, "medium", None) == "CPU"]
    assert stored == BlockStored(
        a.block_keys(1), None, [1, 2], BS, lora_id=7, medium="CPU", lora_name="sql"
    )
    # the base model's prompt with the same tokens has another key: no hit on the adapter's
    assert kv.get_computed_blocks(request("c", [1, 2, 3])) == ([], 0)
