"""Per-request block tables on top of the block pool, with prefix-cache hits (and tier hits)."""

from __future__ import annotations

from kvmesh.common.kv_tiers import MEDIUM_GPU
from kvmesh.engine.block_pool import BlockPool, KVBlock
from kvmesh.engine.kv_offload.shared_tier import WriteThrough
from kvmesh.engine.kv_offload.tiers import by_medium
from kvmesh.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        enable_events: bool = False,
        tiers=None,
    ):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching, enable_events)
        # The tiers behind the cache (kv_offload/tiers.py KVTiers); None: the KV cache alone.
        self.tiers = tiers
        self._tier_hits: dict[str, list] = {}  # the last lookup's tier hits, per request
        if tiers is not None:
            tiers.set_emit(self.pool.emit)
            if tiers.host is not None:
                self.pool.offload = tiers.offload
        # The shared tier's write-through: the blocks each step completes, written once it ran.
        self.write_through = None
        if tiers is not None and tiers.shared is not None:
            self.write_through = WriteThrough(tiers.shared, self.pool, block_size)
            self.pool.on_cached = self.write_through.note
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks registered in the cache
        # Counters for metrics.
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_table(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest run of the request's full blocks already in the cache, then in the tiers.

        At most (num_tokens - 1) tokens are served from the cache: the last token
        is always computed, so the step has logits to sample from. Returns the KV cache's hits
        and the tokens computed with the tiers' hits, which ``allocate_slots`` loads.
        """
        self._tier_hits.pop(request.request_id, None)
        keys, hits = self._cached_run(request)
        if keys is None:
            return [], 0
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        tier_hits = []
        if self.tiers is not None and len(hits) < len(keys):
            tier_hits = self.tiers.lookup(keys[len(hits) :])
            if tier_hits:
                self._tier_hits[request.request_id] = tier_hits
        return hits, (len(hits) + len(tier_hits)) * self.block_size

    def peek_cached_tokens(self, request: Request) -> int:
        """The prompt tokens the KV cache would serve the request now, without side effects (no
        hit counters, no tier reads): what the sjf prefill order ranks by."""
        _, hits = self._cached_run(request)
        return len(hits) * self.block_size

    def _cached_run(self, request: Request) -> tuple[list | None, list[KVBlock]]:
        """The request's full-block keys that may be served from caches (None: none may) and the
        run of them, from the first, that the KV cache holds."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return (
                None,
                [],
            )  # prompt logprobs need logits at every prompt position: compute them all
        keys = request.block_keys((request.num_tokens - 1) // self.block_size)
        hits: list[KVBlock] = []
        for key in keys:
            block = self.pool.lookup(key)
            if block is None:
                break
            hits.append(block)
        return keys, hits

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None
    ) -> list[KVBlock] | None:
        """Make room for `num_new_tokens` more tokens; None (and no change) if blocks run out.

        ``computed_blocks`` (admission): the KV cache's hits from ``get_computed_blocks``; its
        tier hits get fresh blocks here, filled by the step's loads before its forward."""
        admission = computed_blocks is not None
        computed_blocks = computed_blocks or []
        tier_hits = self._tier_hits.pop(request.request_id, []) if admission else []
        held = self.req_blocks.get(request.request_id, [])
        num_computed = (
            request.num_computed_tokens + (len(computed_blocks) + len(tier_hits)) * self.block_size
        )
        needed = (
            cdiv(num_computed + num_new_tokens, self.block_size) - len(held) - len(computed_blocks)
        )
        # Cache hits on free blocks come out of the free list too.
        hits_on_free = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if needed + hits_on_free > self.pool.num_free_blocks:
            return None
        if tier_hits:  # before allocating: the stores that allocation makes skip their slots
            self.tiers.pin(tier_hits)
        self.pool.touch(computed_blocks)
        blocks = self.req_blocks.setdefault(request.request_id, [])
        last = computed_blocks[-1] if computed_blocks else blocks[-1] if blocks else None
        new_blocks = self.pool.allocate(
            max(needed, 0), after=None if last is None else last.block_id
        )
        if tier_hits:
            self.tiers.load(tier_hits, new_blocks)
        if admission and self.tiers is not None:
            self.tiers.hit_tokens[MEDIUM_GPU] += len(computed_blocks) * self.block_size
        if admission and self.tiers is not None and request.num_cached_tokens < 0:
            request.num_cached_tokens_by_medium = by_medium(
                len(computed_blocks), tier_hits, self.block_size
            )
        blocks.extend(computed_blocks)
        blocks.extend(new_blocks)
        if request.request_id not in self.num_cached_blocks:
            self.num_cached_blocks[request.request_id] = len(computed_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        # Tokens scheduled this step are known already (prompt, or the sampled
        # token being fed back), so their full blocks can be registered now; the
        # step writes their KV before any attention reads it.
        bs = self.block_size
        num_full = min(num_tokens, request.num_tokens) // bs
        start = self.num_cached_blocks[request.request_id]
        if num_full <= start:
            return
        keys = request.block_keys(num_full)
        blocks = self.req_blocks[request.request_id]
        self.pool.cache_blocks(
            blocks[start:num_full],
            keys[start:num_full],
            keys[start - 1] if start > 0 else None,
            request.all_token_ids[start * bs : num_full * bs],
            bs,
            request.lora,
        )
        self.num_cached_blocks[request.request_id] = num_full

    def cache_computed(self, request: Request) -> None:
        """Register the full blocks of known tokens whose KV is computed or being computed (async
        scheduling: a block completed by a token that was a placeholder when it was scheduled)."""
        if self.enable_caching and request.request_id in self.num_cached_blocks:
            self._cache_full_blocks(request, request.num_computed_tokens)

    def blocks_written(
        self, request: Request, num_tokens: int, start: int | None = None
    ) -> list[KVBlock]:
        """The blocks that the request's next ``num_tokens`` tokens (from ``start``, by default
        num_computed_tokens) fill."""
        if start is None:
            start = request.num_computed_tokens
        blocks = self.req_blocks.get(request.request_id, [])
        return blocks[start // self.block_size : cdiv(start + num_tokens, self.block_size)]

    def release_lookahead(self, request: Request) -> None:
        """Free the blocks past the request's verified tokens: the lookahead slots of its rejected
        drafts (speculative decoding). They were never cached: only blocks full of verified
        tokens are (``_cache_full_blocks`` stops at ``request.num_tokens``)."""
        blocks = self.req_blocks.get(request.request_id)
        keep = cdiv(request.num_tokens, self.block_size)
        if blocks is not None and len(blocks) > keep:
            tail = blocks[keep:]
            del blocks[keep:]
            self.pool.free(list(reversed(tail)))

    def free(self, request: Request) -> None:
        self._tier_hits.pop(request.request_id, None)
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        # Reverse order: a finished request's tail blocks are evicted before its head.
        self.pool.free(list(reversed(blocks)))

    def reset_prefix_cache(self) -> bool:
        if not self.pool.reset_prefix_cache():
            return False
        if self.tiers is not None:
            self.tiers.clear()
        return True

    def take_transfers(self):
        """The block copies the next step runs before its forward (kv_offload/transfer.py);
        None without tiers."""
        return self.tiers.take_transfers() if self.tiers is not None else None

    def take_completed(self) -> list:
        """The blocks registered since the last call: the step being dispatched completes them."""
        return self.write_through.take() if self.write_through is not None else []

    def write_completed(self, completed: list, kv_caches) -> None:
        """After their step ran: the completed blocks go to the shared tier."""
        if completed:
            self.write_through.write(completed, kv_caches)

    def take_events(self):
        events = self.pool.take_events()
        if self.tiers is not None and self.tiers.shared_events is not None:
            events += self.tiers.shared_events.take()  # the shared tier's, from its writer
        return events
