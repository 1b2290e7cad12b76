"""A fixed pool of KV blocks: O(1) allocation, reference counts, a prefix cache.

Modelled on vLLM V1. Blocks live in one preallocated list; free blocks sit in
an intrusive doubly linked list (no per-step object churn, O(1) removal from
the middle when a cached free block is hit again). A free block keeps its
cached key until it is reallocated, so the free list doubles as the LRU order
of evictable cached blocks: the head is evicted first.
"""

from __future__ import annotations

from kvmesh.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored


class KVBlock:
    __slots__ = (
        "block_id",
        "ref_cnt",
        "key",
        "parent_key",
        "prev_free",
        "next_free",
        "freed_at",
        "token_ids",
        "lora",
    )

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.key: int | None = None  # set while the block is registered in the prefix cache
        self.parent_key: int | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None
        self.freed_at = -1  # BlockPool's free clock when it last went to the back of the free list
        # With a host tier: the cached block's tokens and adapter, for its event once evicted.
        self.token_ids: tuple[int, ...] | None = None
        self.lora = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, key={self.key})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinel ends."""

    def __init__(self, blocks: list[KVBlock]):
        self.head = KVBlock(-1)
        self.tail = KVBlock(-1)
        self.num_free = 0
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        for block in blocks:
            self.append(block)

    def _insert_after(self, anchor: KVBlock, block: KVBlock) -> None:
        nxt = anchor.next_free
        block.prev_free, block.next_free = anchor, nxt
        anchor.next_free = block
        nxt.prev_free = block  # type: ignore[union-attr]
        self.num_free += 1

    def append(self, block: KVBlock) -> None:
        self._insert_after(self.tail.prev_free, block)  # type: ignore[arg-type]

    def appendleft(self, block: KVBlock) -> None:
        self._insert_after(self.head, block)

    def remove(self, block: KVBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        block = self.head.next_free
        if block is self.tail or block is None:
            raise RuntimeError("no free KV blocks")
        self.remove(block)
        return block

    def __iter__(self):
        block = self.head.next_free
        while block is not self.tail and block is not None:
            yield block
            block = block.next_free


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def _freed_at(block: KVBlock) -> int:
    return block.freed_at


def _cheap_to_take(block: KVBlock, protect_from: int) -> bool:
    """Free, and holding no cached content or freed before `protect_from` on the pool's free clock
    (allocate keeps the most recently freed blocks from being taken before their turn)."""
    return block.ref_cnt == 0 and (block.key is None or block.freed_at < protect_from)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, enable_events: bool = False):
        if num_blocks <= 0:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_events = enable_events
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVBlock] = {}
        self.events: list[KVEvent] = []
        self.free_clock = 0  # counts blocks put at the back of the free list
        # Called with each cached block that allocate evicts, before it is reused (the host
        # tier's copy-on-evict); None: evicted content is dropped.
        self.offload = None
        # Called with each block as it is registered (its parent key, tokens and adapter): the
        # shared tier's write-through; None: nobody asks.
        self.on_cached = None

    # -- prefix cache -------------------------------------------------------
    def lookup(self, key: int) -> KVBlock | None:
        return self.cached.get(key)

    def cache_blocks(
        self,
        blocks: list[KVBlock],
        keys: list[int],
        parent_key: int | None,
        token_ids: list[int],
        block_size: int,
        lora=None,
    ) -> None:
        """Register newly full blocks under their keys: one BlockStored event per contiguous run.

        ``lora``: the adapter the blocks were computed with (its int id and name go in the events);
        None: the base model.

        Each event is one continuous chain from a parent the cache holds (its parent, then every
        block chained from the one before it), because a vLLM-format consumer recomputes the keys
        from the token ids and keys each event from its parent's entry:
        * a block whose key is already cached (the same content computed twice) is not stored;
          it ends the run, and the next stored block starts a new event chained from that key;
        * a block whose parent is no longer cached (the request's copy of the parent was a
          duplicate, and the cached copy has been evicted since) is not stored either, nor what
          follows it until a cached key resumes the chain: such a block could not be a prefix
          hit before its parent is computed again, and its event could not be keyed."""
        run_keys: list[int] = []
        run_tokens: list[int] = []
        run_parent = parent_key
        parent_live = parent_key is None or parent_key in self.cached
        for i, (block, key) in enumerate(zip(blocks, keys)):
            if block.key is not None:
                raise RuntimeError(f"{block} is already cached")
            if key in self.cached or not parent_live:
                # Same content computed twice concurrently: keep the first copy; this one stays an
                # ordinary block and is freed normally. Or an orphan: it stays ordinary too.
                self._emit_stored(run_keys, run_parent, run_tokens, block_size, lora)
                run_keys, run_tokens = [], []
                parent_key = run_parent = key
                parent_live = key in self.cached
                continue
            block.key, block.parent_key = key, parent_key
            if self.offload is not None:
                block.token_ids = tuple(token_ids[i * block_size : (i + 1) * block_size])
                block.lora = lora
            if self.on_cached is not None:
                self.on_cached(
                    block, parent_key, token_ids[i * block_size : (i + 1) * block_size], lora
                )
            self.cached[key] = block
            run_keys.append(key)
            run_tokens.extend(token_ids[i * block_size : (i + 1) * block_size])
            parent_key = key
        self._emit_stored(run_keys, run_parent, run_tokens, block_size, lora)

    def emit(self, event: KVEvent) -> None:
        """Queue an event (the host tier's go here too, in order with the KV cache's)."""
        if self.enable_events:
            self.events.append(event)

    def _emit_stored(
        self, keys: list[int], parent: int | None, tokens: list[int], block_size: int, lora
    ) -> None:
        if self.enable_events and keys:
            self.events.append(
                BlockStored(
                    keys,
                    parent,
                    tokens,
                    block_size,
                    lora_id=None if lora is None else lora.int_id,
                    medium="GPU",
                    lora_name=None if lora is None else lora.name,
                )
            )

    def uncache(self, blocks: list[KVBlock]) -> None:
        """Take blocks out of the prefix cache (their content was never computed: a failed step)."""
        for block in blocks:
            if block.key is not None and self.cached.get(block.key) is block:
                self._evict(block)

    def _evict(self, block: KVBlock) -> None:
        if block.key is not None:
            del self.cached[block.key]
            if self.enable_events:
                self.events.append(BlockRemoved([block.key]))
            block.key = block.parent_key = None
            block.token_ids = block.lora = None

    # -- allocation -----------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def allocate(self, n: int, after: int | None = None) -> list[KVBlock]:
        """n blocks, taken in runs of consecutive ids: the first run goes on from block `after`
        (the request's last block), each later one starts at the first block in eviction order.
        A run goes on while the next block is free and cheap to take (`_cheap_to_take`).

        Why: the CPU attention kernels read each head's context block by block, one 4 KiB page
        per block, and the hardware prefetchers follow pages in ascending order far better than
        scattered or descending ones (decode attention, SmolLM2's blocks on Zen 5: in order
        31-35 GB/s, descending 24-28, scattered 19-21). Once the pool has wrapped, the first
        blocks in eviction order are whatever earlier requests freed, tail first, and a decoding
        request's next block would land anywhere. Taking a block before its turn costs the prefix
        cache little when the block holds nothing cached or was freed long enough ago: cached
        blocks go to the back of the free list, so the most recently freed are the last to go,
        and a cached block that is among the last k freed, k half the blocks this call leaves
        free, is never taken before its turn."""
        if n > self.free_queue.num_free:
            raise RuntimeError(f"asked for {n} blocks, {self.free_queue.num_free} free")
        out: list[KVBlock] = []
        # Of the blocks this call leaves free, the more recently freed half keeps its turn.
        protect_from = self.free_clock - (self.free_queue.num_free - n) // 2
        nxt = -1 if after is None else after + 1
        while len(out) < n:
            if 0 <= nxt < self.num_blocks and _cheap_to_take(self.blocks[nxt], protect_from):
                block = self.blocks[nxt]  # the run goes on
            else:
                # A new run, from the first block in eviction order, or from a block before it:
                # a request's blocks are freed tail first, so the first in eviction order is
                # often the last of a run that is free before it.
                block = self.free_queue.head.next_free
                start, want = block.block_id, n - len(out)
                while (
                    start > 0
                    and block.block_id - start + 1 < want
                    and _cheap_to_take(self.blocks[start - 1], protect_from)
                ):
                    start -= 1
                block = self.blocks[start]
            self.free_queue.remove(block)
            block.ref_cnt = 1
            out.append(block)
            nxt = block.block_id + 1
        for block in sorted(out, key=_freed_at):  # evicted (and reported) in eviction order
            if block.key is not None and self.offload is not None:
                self.offload(block)
            self._evict(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cache hits; a hit on a free block takes it off the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference each, in eviction order (first freed = evicted first among them).

        Blocks that hold no cached content go to the head: they are worthless to keep.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.key is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)
                    block.freed_at = self.free_clock
                    self.free_clock += 1

    def reset_prefix_cache(self) -> bool:
        """Forget all cached content; only possible when no block is in use."""
        if self.free_queue.num_free != self.num_blocks:
            return False
        for block in self.blocks:
            block.key = block.parent_key = None
            block.token_ids = block.lora = None
        self.cached.clear()
        if self.enable_events:
            self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    @property
    def usage(self) -> float:
        return 1.0 - self.free_queue.num_free / self.num_blocks
