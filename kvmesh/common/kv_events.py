"""Contract 2: KV-cache events, engine -> sidecar, in vLLM's wire format.

vLLM (``vllm/distributed/kv_events.py``) defines its events as msgspec Structs with
``omit_defaults=True``, tagged by class name. Our engine encodes them array-like (msgpack):

    EventBatch    = [ts, [event, ...], data_parallel_rank]
    BlockStored   = ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                     lora_id, medium, lora_name, ...]
    BlockRemoved  = ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared = ["AllBlocksCleared"]

vLLM 0.32 encodes the batch so, and each event as a map ``{"type": "BlockStored",
"block_hashes": ..., ...}``, read here by field name. Block hashes are ints (uint64: our
engine's contract-1 keys, or vLLM 0.32's own) or bytes (older vLLMs' sha256 hashes). The
decoder accepts missing trailing optional fields and ignores extra trailing fields, so it
reads older and newer vLLM versions too. Anything else that is not this schema (not msgpack,
a field of the wrong type, an unknown event kind) raises ``DecodeError``, the only exception
``decode_batch`` raises; the subscriber counts it and resyncs (see ``KVEventSubscriber``).

Transport (vLLM's ``ZmqEventPublisher``): a PUB socket sends multipart
``[topic, seq (8 bytes big-endian), payload]``; a ROUTER replay socket receives
``[client_id, b"", start_seq]`` from a DEALER and answers every buffered message with
``seq >= start_seq`` as ``[client_id, b"", topic, seq, payload]``, then the end marker
``[client_id, b"", b"", (-1 as 8 signed bytes), b""]`` (vLLM 0.32; our publisher sends the
same without the topic frame, and the subscriber reads both). Our replay socket never drops a
message of an answer (its send high-water mark holds a whole buffer, and a full pipe waits
instead of dropping). One extension: ``SNAPSHOT_REQ`` (-2 as 8 signed bytes) as the start
asks for the publisher's whole block set instead, answered as ``[N, EventBatch]`` (the state
after every batch before seq ``N``) and the end marker; vLLM's publisher answers it with the
end marker alone.

This module has the encoder and decoder, ``KVEventPublisher`` (used by the engine
server) and ``KVEventSubscriber`` (used by the sidecar: gap detection, replay, snapshots).
"""

from __future__ import annotations

import logging
import threading
import time
from array import array
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

log = logging.getLogger("kvmesh.kv_events")

BlockHash = int | bytes
END_SEQ = (-1).to_bytes(8, "big", signed=True)
# Asked for as the start seq: a snapshot of the block set instead of the buffered batches (a kvmesh
# extension; vLLM's publisher answers it with the end marker alone, as for any seq it does not hold).
SNAPSHOT_REQ = (-2).to_bytes(8, "big", signed=True)


@dataclass
class BlockStored:
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None  # the adapter's name (vLLM); None: the base model

    def to_wire(self) -> list[Any]:
        wire = [
            "BlockStored",
            list(self.block_hashes),
            self.parent_block_hash,
            list(self.token_ids),
            self.block_size,
            self.lora_id,
            self.medium,
        ]
        return wire if self.lora_name is None else [*wire, self.lora_name]


@dataclass
class BlockRemoved:
    block_hashes: list[BlockHash]
    medium: str | None = None

    def to_wire(self) -> list[Any]:
        return ["BlockRemoved", list(self.block_hashes), self.medium]


@dataclass
class AllBlocksCleared:
    def to_wire(self) -> list[Any]:
        return ["AllBlocksCleared"]


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class EventBatch:
    ts: float
    events: list[KVEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None


class DecodeError(ValueError):
    """The one error the decoder raises: the payload is not a well-formed EventBatch.

    Raised for bytes that are not msgpack, for a structure that is not
    ``[ts, [event, ...], dp_rank?]``, for a field of the wrong type (a hash that is not an
    int or bytes, a token id that is not a uint32, a block size that is not a positive
    int, ...) and for an event kind this decoder does not know. A batch is decoded
    all-or-nothing: a consumer never sees half of a bad batch."""


def encode_batch(
    events: Iterable[KVEvent], ts: float | None = None, data_parallel_rank: int | None = None
) -> bytes:
    """msgpack bytes of an EventBatch, byte-identical to vLLM's msgspec encoding."""
    wire = [
        time.time() if ts is None else float(ts),
        [e.to_wire() for e in events],
        data_parallel_rank,
    ]
    return msgpack.packb(wire, use_bin_type=True)


_MAX_REPR = 80


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_REPR else text[:_MAX_REPR] + "..."


def _is_int(v: Any) -> bool:
    return type(v) is int  # bool is an int subclass, and never a valid field here


def _hash(v: Any, what: str) -> BlockHash:
    if _is_int(v) or type(v) is bytes:
        return v
    raise DecodeError(f"{what} must be an int or bytes, got {type(v).__name__} {_short(v)}")


def _opt_hash(v: Any, what: str) -> BlockHash | None:
    return None if v is None else _hash(v, what)


def _hashes(v: Any, what: str) -> list[BlockHash]:
    if not isinstance(v, list):
        raise DecodeError(f"{what} must be an array, got {type(v).__name__}")
    return [_hash(h, what) for h in v]


def _token_ids(v: Any) -> list[int]:
    if not isinstance(v, list):
        raise DecodeError(f"BlockStored.token_ids must be an array, got {type(v).__name__}")
    for t in v:
        if not _is_int(t) or not 0 <= t <= 0xFFFFFFFF:
            raise DecodeError(f"BlockStored.token_ids must hold uint32 ints, got {_short(t)}")
    return v


def _opt_int(v: Any, what: str) -> int | None:
    if v is None or _is_int(v):
        return v
    raise DecodeError(f"{what} must be an int or nil, got {type(v).__name__}")


def _opt_str(v: Any, what: str) -> str | None:
    if v is None or type(v) is str:
        return v
    raise DecodeError(f"{what} must be a string or nil, got {type(v).__name__}")


def _opt(items: list[Any], i: int) -> Any:
    return items[i] if len(items) > i else None


# The fields of each event kind in wire order: a map-encoded event (vLLM 0.32's) is read by name.
_FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def _from_map(item: dict) -> list[Any]:
    """A map-encoded event as the tagged array: its known fields in wire order (a field the map
    omits, as msgspec's omit_defaults does, is nil; one this decoder does not know is ignored)."""
    tag = item.get("type")
    if type(tag) is bytes:
        tag = tag.decode(errors="replace")
    fields = _FIELDS.get(tag)
    if fields is None:
        return [tag]
    if not all(type(k) is str for k in item):  # keyed by position: its values in order
        return [tag] + [v for k, v in item.items() if k != "type"]
    missing = [f for f in fields[:4] if f not in item] if tag == "BlockStored" else []
    if missing:
        raise DecodeError(f"{tag} lacks {', '.join(missing)}")
    return [tag, *(item.get(f) for f in fields)]


def _decode_event(item: Any) -> KVEvent:
    if isinstance(item, dict):
        item = _from_map(item)
    if not isinstance(item, list) or not item:
        raise DecodeError(f"event is not a tagged array: {_short(item)}")
    tag = item[0]
    if type(tag) is bytes:
        try:
            tag = tag.decode()
        except UnicodeDecodeError:
            raise DecodeError(f"event tag is not text: {_short(tag)}") from None
    if tag == "BlockStored":
        if len(item) < 5:
            raise DecodeError(f"BlockStored needs 4 fields, got {len(item) - 1}")
        block_size = item[4]
        if not _is_int(block_size) or block_size <= 0:
            raise DecodeError(
                f"BlockStored.block_size must be a positive int, got {_short(block_size)}"
            )
        return BlockStored(
            _hashes(item[1], "BlockStored.block_hashes"),
            _opt_hash(item[2], "BlockStored.parent_block_hash"),
            _token_ids(item[3]),
            block_size,
            _opt_int(_opt(item, 5), "BlockStored.lora_id"),
            _opt_str(_opt(item, 6), "BlockStored.medium"),
            _opt_str(_opt(item, 7), "BlockStored.lora_name"),
        )
    if tag == "BlockRemoved":
        if len(item) < 2:
            raise DecodeError("BlockRemoved needs block_hashes")
        return BlockRemoved(
            _hashes(item[1], "BlockRemoved.block_hashes"),
            _opt_str(_opt(item, 2), "BlockRemoved.medium"),
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    # An event this decoder does not know may change the engine's cache in a way the index
    # cannot follow: the batch is undecodable (the subscriber resyncs), never silently skipped.
    raise DecodeError(f"unknown KV event kind {_short(tag)}")


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one msgpack EventBatch. Raises only :class:`DecodeError` (any input)."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several types (and TypeError, ValueError...)
        raise DecodeError(f"not msgpack: {type(exc).__name__}: {_short(str(exc))}") from None
    if not isinstance(raw, list) or len(raw) < 2:
        raise DecodeError(
            f"EventBatch must be an array [ts, events, ...], got {type(raw).__name__}"
        )
    ts = raw[0]
    if not (_is_int(ts) or type(ts) is float):
        raise DecodeError(f"EventBatch.ts must be a number, got {type(ts).__name__}")
    try:
        ts = float(ts)
    except OverflowError:
        raise DecodeError(f"EventBatch.ts out of range: {_short(ts)}") from None
    if not isinstance(raw[1], list):
        raise DecodeError(f"EventBatch.events must be an array, got {type(raw[1]).__name__}")
    events = [_decode_event(x) for x in raw[1]]
    return EventBatch(
        ts=ts,
        events=events,
        data_parallel_rank=_opt_int(_opt(raw, 2), "EventBatch.data_parallel_rank"),
    )


class PublishedBlockSet:
    """The block set that the published events describe: what a subscriber that missed nothing
    holds. Kept by the publisher so that a subscriber that fell further behind than the replay
    buffer reaches can start over from a snapshot instead of living with a partial index.

    Keyed by (block hash, medium); insertion order is store order. The token ids of one
    BlockStored are kept once, as a uint32 array (4 bytes a token) its blocks point into: the
    publisher's cost per event is one array and a dict entry per block."""

    def __init__(self):
        # (hash, medium) -> (parent hash, the event's tokens, this block's offset in them, block
        # size, lora id, lora name)
        self.blocks: dict[
            tuple[BlockHash, str | None],
            tuple[BlockHash | None, array, int, int, int | None, str | None],
        ] = {}

    def apply(self, events: Iterable[KVEvent]) -> None:
        for ev in events:
            if isinstance(ev, BlockStored):
                bs = ev.block_size
                parent = ev.parent_block_hash
                tokens = array("I", ev.token_ids)
                for i, h in enumerate(ev.block_hashes):
                    self.blocks[(h, ev.medium)] = (
                        parent,
                        tokens,
                        i * bs,
                        bs,
                        ev.lora_id,
                        ev.lora_name,
                    )
                    parent = h
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    self.blocks.pop((h, ev.medium), None)
            elif isinstance(ev, AllBlocksCleared):
                self.blocks.clear()

    def copy(self) -> dict:
        return dict(self.blocks)

    @staticmethod
    def snapshot_events(blocks: dict) -> list[KVEvent]:
        """AllBlocksCleared, then one BlockStored per block, every parent before its children
        (a subscriber that derives keys from parents, like the sidecar with vLLM's hashes, needs
        that order; store order almost always is, a parent stored again after its child is not)."""
        events: list[KVEvent] = [AllBlocksCleared()]
        emitted: set = set()
        for key in blocks:
            chain = []
            k = key
            while k is not None and k in blocks and k not in emitted:
                emitted.add(k)
                chain.append(k)
                parent = blocks[k][0]
                k = None if parent is None else (parent, k[1])
            for h, medium in reversed(chain):
                parent, tokens, offset, bs, lora_id, lora_name = blocks[(h, medium)]
                ids = tokens[offset : offset + bs].tolist()
                events.append(BlockStored([h], parent, ids, bs, lora_id, medium, lora_name))
        return events


class KVEventPublisher:
    """vLLM-compatible ZMQ publisher: PUB for live events plus a ROUTER replay socket.

    ``publish(events)`` is thread-safe. The replay buffer keeps the last ``buffer_steps``
    batches; a background thread answers replay requests. The replay socket never drops a
    batch of an answer: its send high-water mark holds a whole answer, and a client that
    reads slower than that is waited for (``ROUTER_MANDATORY``: ZMQ's ROUTER would otherwise
    drop what is over the mark in silence), up to ``replay_send_timeout_s`` without progress,
    after which that answer is abandoned (the client sees no end marker and asks again).

    With ``snapshots`` (the default) the publisher also keeps the block set its events
    describe (:class:`PublishedBlockSet`) and answers a snapshot request (``SNAPSHOT_REQ``
    as the start sequence number) with one message ``[N, EventBatch]``: AllBlocksCleared,
    then every block, equal to having applied every batch before seq ``N``; then the end
    marker. A vLLM publisher answers that request with the end marker alone.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        snapshots: bool = True,
        replay_send_timeout_s: float = 10.0,
    ):
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        try:
            self._pub.bind(endpoint)
        except zmq.ZMQError:
            self._pub.close(0)
            raise
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._topic = topic.encode()
        self._seq = 0
        self._lock = threading.Lock()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._block_set = PublishedBlockSet() if snapshots else None
        self._closed = threading.Event()
        self._replay = None
        self.replay_endpoint: str | None = None
        self._thread: threading.Thread | None = None
        self.replay_send_timeout_s = replay_send_timeout_s
        self.stats = {"replay_requests": 0, "snapshots_sent": 0, "replays_abandoned": 0}
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            # A whole answer (every buffered batch + the end marker) fits under the mark, and a
            # full pipe blocks the send (up to the timeout) instead of dropping in silence.
            self._replay.setsockopt(zmq.SNDHWM, buffer_steps + 2)
            self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
            try:
                self._replay.bind(replay_endpoint)
            except zmq.ZMQError:
                self._replay.close(0)
                self._pub.close(0)
                raise
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(
                target=self._serve_replay, name="kv-events-replay", daemon=True
            )
            self._thread.start()

    @property
    def next_seq(self) -> int:
        return self._seq

    def publish(self, events: Iterable[KVEvent], ts: float | None = None) -> int | None:
        """Publish one EventBatch; returns its sequence number (None if there was nothing)."""
        events = list(events)
        if not events or self._closed.is_set():
            return None
        payload = encode_batch(events, ts)
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
            if self._block_set is not None:
                self._block_set.apply(events)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        return seq

    def _answer(self, start: bytes) -> list[tuple[int, bytes]]:
        """The messages answering one request: buffered batches from a start seq, or a snapshot."""
        if start == SNAPSHOT_REQ:
            if self._block_set is None:
                return []
            with self._lock:  # a copy under the lock (fast); the encoding outside it
                next_seq, blocks = self._seq, self._block_set.copy()
            self.stats["snapshots_sent"] += 1
            return [(next_seq, encode_batch(PublishedBlockSet.snapshot_events(blocks)))]
        start_seq = int.from_bytes(start, "big")
        with self._lock:
            return [(s, p) for s, p in self._buffer if s >= start_seq]

    def _serve_replay(self) -> None:
        assert self._replay is not None
        poller = zmq.Poller()
        poller.register(self._replay, zmq.POLLIN)
        while not self._closed.is_set():
            try:
                if not poller.poll(100):
                    continue
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                if self._closed.is_set():
                    return
                continue
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("invalid replay request with %d frames", len(frames))
                continue
            client_id, _, start = frames
            self.stats["replay_requests"] += 1
            items = self._answer(start)
            try:
                for seq, payload in items:
                    self._send_to(client_id, seq.to_bytes(8, "big"), payload)
                self._send_to(client_id, END_SEQ, b"")
            except (
                zmq.ZMQError
            ) as exc:  # the client is gone (EHOSTUNREACH) or stopped reading (EAGAIN)
                self.stats["replays_abandoned"] += 1
                if not self._closed.is_set():
                    log.warning("replay answer of %d messages abandoned: %s", len(items), exc)

    def _send_to(self, client_id: bytes, seq: bytes, payload: bytes) -> None:
        """Send one answer message, waiting while the client's pipe is full (a slow reader), up to
        ``replay_send_timeout_s`` without progress; never blocking a close() for long."""
        deadline = time.monotonic() + self.replay_send_timeout_s
        while True:
            try:
                self._replay.send_multipart((client_id, b"", seq, payload), zmq.NOBLOCK)
                return
            except zmq.Again:
                if self._closed.is_set() or time.monotonic() > deadline:
                    raise
                self._closed.wait(0.002)

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        with self._lock:
            self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)


def _answer_frames(frames: list[bytes]) -> list[bytes]:
    """A replay answer's [seq, payload], from vLLM 0.32's ``[b"", topic, seq, payload]`` or our
    publisher's ``[b"", seq, payload]``; anything else is returned as it came (malformed)."""
    if len(frames) in (3, 4) and frames[0] == b"":
        return frames[-2:]
    return frames


@dataclass
class Delivery:
    """What a subscriber hands its consumer: a batch in order, or a reset of all state."""

    seq: int | None
    batch: EventBatch | None = None
    reset: str | None = None  # reason; the consumer must drop everything it derived so far


class KVEventSubscriber:
    """SUB (+ DEALER replay) client with gap detection and healing.

    ``poll()`` returns deliveries in sequence order, with no batch missing in silence:
      * a gap (the live seq jumps ahead, or a replay answer skips a seq) is counted
        (``stats["gaps"]``, and the missing batches in ``stats["gap_batches"]``) and healed:
        the missing range is replayed (asked for again from the first hole, up to
        ``max_replay_attempts`` answers); a range the publisher no longer buffers is healed
        from its snapshot (``stats["snapshots"]``: a reset, then the publisher's whole block
        set). A publisher without snapshots (vLLM) cannot heal that: a reset, then what it
        still buffers; counted in ``stats["gap_resets"]`` and logged;
      * a replay socket that does not answer: the gap is a reset too (``gap_resets``), and a
        full resync (reset, replay from 0 or snapshot) is retried with a backoff until the
        socket answers (``stats["replay_failures"]`` counts the failed tries);
      * a publisher restart (the live seq goes backwards): a reset, then a replay from 0;
      * ``request_resync()`` (e.g. the engine's process start time changed): same as restart;
      * a batch that does not decode (:class:`DecodeError`: not msgpack, a field of the
        wrong type, an unknown event kind) or a malformed frame: counted in
        ``stats["decode_errors"]``, then a replay from that sequence number (a frame
        damaged on the way is intact in the publisher's buffer). A batch that is
        undecodable in the buffer too is lost: its effect on the cache is unknown, so a
        reset is delivered and the index is rebuilt from the batches after it (what the
        index then holds is a subset of the engine's cache, never a block it dropped).
        A batch is re-fetched at most once (a replayed batch is never retried), so a bad
        publisher cannot make the subscriber loop.
    On the first poll it replays from 0 so a sidecar that starts after its engine catches up.
    ``poll()`` raises only for a closed socket: nothing in a message can make it raise.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        replay_timeout_s: float = 1.0,
        validate=None,
        max_replay_attempts: int = 3,
        resync_backoff_max_s: float = 30.0,
    ):
        self._ctx = zmq.Context.instance()
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.replay_timeout_s = replay_timeout_s  # silence that ends a replay answer
        self.max_replay_attempts = max_replay_attempts
        self.resync_backoff_max_s = resync_backoff_max_s
        # Optional consumer check of a decoded batch (raises DecodeError), e.g. the sidecar's
        # "hashes are uint64 contract keys": a failing batch is handled like an undecodable one.
        self.validate = validate
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, 100_000)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        # Watch the connection: a reconnect means the engine (publisher) probably restarted,
        # and ZMQ's slow-joiner effect may hide the new stream's first sequence numbers.
        self._monitor = self._sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._was_disconnected = False
        self._sub.connect(endpoint)
        self._dealer = None
        self.next_seq: int | None = None
        self._last_live_seq: int | None = None
        self._needs_catch_up = True  # a full catch-up (replay from 0) is due
        self._catch_up_at = 0.0  # not before this (monotonic): the backoff after a failed one
        self._catch_up_backoff = 1.0
        self._resync_reason: str | None = None
        self.caught_up = False  # the first catch-up (replay from 0) has run
        self.last_decode_error: str | None = None
        self.replay_problem: str | None = None  # why the last full resync failed (None: it did not)
        self.stats = {
            "batches": 0,
            "gaps": 0,
            "gap_batches": 0,
            "replays": 0,
            "snapshots": 0,
            "gap_resets": 0,
            "replay_failures": 0,
            "resets": 0,
            "decode_errors": 0,
            "lost_batches": 0,
        }

    # -- replay ---------------------------------------------------------------------------
    def _ask(self, request: bytes) -> tuple[list[tuple[int, bytes]], bool] | None:
        """One request to the replay socket: (messages, ended), where `ended` says the end marker
        arrived; an answer that stops (``replay_timeout_s`` of silence) is (what came, False).
        None: no answer at all (or no replay socket)."""
        if not self.replay_endpoint:
            return None
        if self._dealer is None:
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.setsockopt(zmq.RCVHWM, 0)  # a whole answer: nothing dropped on this side
            self._dealer.connect(self.replay_endpoint)
        self._dealer.send_multipart((b"", request))
        out: list[tuple[int, bytes]] = []
        while True:
            if not self._dealer.poll(int(self.replay_timeout_s * 1000) + 1):
                # Drop the socket so that a late answer cannot be taken for the next one's.
                self._dealer.close(0)
                self._dealer = None
                return (out, False) if out else None
            frames = _answer_frames(self._dealer.recv_multipart())
            if len(frames) != 2 or len(frames[0]) != 8:
                self._bad_frame(f"replay answer with {len(frames)} frames")
                continue
            seq_b, payload = frames
            if seq_b == END_SEQ:
                return out, True
            out.append((int.from_bytes(seq_b, "big"), payload))

    def _replay_from(self, start: int) -> tuple[list[tuple[int, bytes]], bool] | None:
        """The buffered batches with seq >= start (see `_ask`)."""
        if not self.replay_endpoint:
            return None
        self.stats["replays"] += 1
        return self._ask(start.to_bytes(8, "big"))

    def _snapshot(self) -> tuple[int, EventBatch] | None:
        """The publisher's block set as one batch, and the first seq it does not cover; None
        from a publisher without snapshots (vLLM's answers the request with the end marker)."""
        answer = self._ask(SNAPSHOT_REQ)
        if answer is None or not answer[1] or len(answer[0]) != 1:
            return None
        next_seq, payload = answer[0][0]
        got = self._decode(next_seq, payload)
        return None if isinstance(got, DecodeError) else (next_seq, got)

    def request_resync(self, reason: str) -> None:
        self._resync_reason = reason

    def _bad_frame(self, what: str) -> None:
        self.stats["decode_errors"] += 1
        self.last_decode_error = what
        log.warning("malformed KV-event message: %s", what)

    def _decode(self, seq: int, payload: bytes) -> EventBatch | DecodeError:
        try:
            batch = decode_batch(payload)
            if self.validate is not None:
                self.validate(batch)
            return batch
        except DecodeError as exc:
            self.stats["decode_errors"] += 1
            self.last_decode_error = f"seq {seq}: {exc}"
            log.warning("undecodable KV-event batch seq=%d: %s", seq, exc)
            return exc

    def _reset(self, reason: str) -> Delivery:
        self.stats["resets"] += 1
        log.info("KV-event state reset: %s", reason)
        return Delivery(seq=None, reset=reason)

    def _gap(self, missing_from: int, got: int, where: str) -> None:
        self.stats["gaps"] += 1
        self.stats["gap_batches"] += got - missing_from
        log.warning(
            "KV-event gap in the %s: seq %d..%d missing; healing", where, missing_from, got - 1
        )

    def _heal_from_snapshot(self, missing_from: int, out: list[Delivery]) -> bool:
        snap = self._snapshot()
        if snap is None:
            return False
        next_seq, batch = snap
        self.stats["snapshots"] += 1
        out.append(
            self._reset(
                f"seq {missing_from} is no longer buffered: rebuilding from the publisher's "
                f"block-set snapshot (every batch before seq {next_seq})"
            )
        )
        out.append(Delivery(seq=next_seq - 1, batch=batch))
        self.next_seq = next_seq
        return True

    def _lose(self, missing_from: int, got: int | None, out: list[Delivery]) -> None:
        """A gap nothing can fill: reset (the index then holds a subset of the engine's cache)."""
        self.stats["gap_resets"] += 1
        what = f"seq {missing_from}..{got - 1}" if got is not None else f"seq {missing_from} on"
        out.append(self._reset(f"{what} lost: neither replayed nor in a snapshot"))
        self.next_seq = None

    def _schedule_full_resync(self) -> None:
        if self.replay_endpoint:
            self._needs_catch_up = True
            self._catch_up_at = time.monotonic() + self._catch_up_backoff
            self._catch_up_backoff = min(self._catch_up_backoff * 2, self.resync_backoff_max_s)

    def _accept(self, seq: int, payload: bytes, out: list[Delivery], live: bool) -> None:
        """Deliver batch `seq` (the next in order) into `out`; on a decode error, recover."""
        got = self._decode(seq, payload)
        if isinstance(got, EventBatch):
            self.stats["batches"] += 1
            out.append(Delivery(seq=seq, batch=got))
            self.next_seq = seq + 1
            return
        if live and self.replay_endpoint:
            # A live frame that does not decode: the publisher's buffer may hold it intact.
            # (Replayed batches are never retried again: a bad publisher cannot make this loop.)
            self.next_seq = seq
            self._catch_up(seq, out)
            if self.next_seq is not None and self.next_seq > seq:
                # The replay delivered seq and what followed; or it found seq undecodable too,
                # or no longer buffered, and delivered a reset before what followed.
                return
        self.stats["lost_batches"] += 1
        out.append(
            self._reset(
                f"KV-event batch seq {seq} is undecodable ({got}); "
                "rebuilding the index from the batches after it"
            )
        )
        self.next_seq = seq + 1

    def _catch_up(self, start: int, out: list[Delivery]) -> bool:
        """Deliver into `out`, in order and without a hole, every batch from `start` that the
        publisher has sent. True when done; False when the replay socket did not answer or
        kept answering with holes and nothing filled them (a full resync is then due)."""
        want = start
        for _ in range(self.max_replay_attempts):
            answer = self._replay_from(want)
            if answer is None:
                return False
            items, ended = answer
            i, first = 0, True
            hole = False
            while i < len(items):
                seq, payload = items[i]
                if seq < want:  # delivered already (an earlier answer, the live stream, a snapshot)
                    i += 1
                    continue
                if seq == want:
                    self._accept(seq, payload, out, live=False)
                    want, i, first = seq + 1, i + 1, False
                    continue
                self._gap(want, seq, "replay answer")
                if not first:
                    hole = (
                        True  # dropped on the way (the publisher had sent what follows): ask again
                    )
                    break
                first = False
                # The answer starts after `want`: the publisher no longer buffers it.
                if self._heal_from_snapshot(want, out):
                    want = self.next_seq
                else:
                    self._lose(want, seq, out)
                    want = seq
            if ended and not hole:
                return True
        if self._heal_from_snapshot(want, out):
            return True
        return False

    def _full_catch_up(self, out: list[Delivery]) -> None:
        """Rebuild from scratch: a reset if anything was delivered since, then replay from 0."""
        if self.next_seq is not None:
            out.append(self._reset("full resync after a failed replay"))
            self.next_seq = None
        self._needs_catch_up = False
        if self._catch_up(0, out) or not self.replay_endpoint:
            self._catch_up_backoff = 1.0
            self.replay_problem = None
        else:
            self.stats["replay_failures"] += 1
            self.replay_problem = (
                f"the replay socket {self.replay_endpoint} did not answer a replay from seq 0"
                + (
                    f" (last malformed message: {self.last_decode_error})"
                    if self.last_decode_error
                    else ""
                )
            )
            # A sidecar that starts before its engine sees this once or twice: not worth a warning.
            level = logging.WARNING if self._catch_up_backoff >= 4 else logging.INFO
            log.log(
                level,
                "the KV-event replay socket %s did not answer; a full resync again in %.0fs",
                self.replay_endpoint,
                self._catch_up_backoff,
            )
            self._schedule_full_resync()
        self.caught_up = True

    # -- main loop ------------------------------------------------------------------------
    def _check_connection(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self._was_disconnected = True
            elif event == zmq.EVENT_CONNECTED and self._was_disconnected:
                self._was_disconnected = False
                self.request_resync(
                    "reconnected to the engine's KV-event socket (engine restarted?)"
                )

    def poll(self, timeout_ms: int = 100, max_messages: int = 1000) -> list[Delivery]:
        out: list[Delivery] = []
        self._check_connection()
        if self._resync_reason is not None:
            out.append(self._reset(self._resync_reason))
            self._resync_reason = None
            self.next_seq = None
            self._last_live_seq = None
            self._needs_catch_up = True
            self._catch_up_at = 0.0
        if self._needs_catch_up and time.monotonic() >= self._catch_up_at:
            self._full_catch_up(out)
        if not self._sub.poll(timeout_ms):
            self._check_connection()
            return out
        replayed_for_bad_frame = False
        for _ in range(max_messages):
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 3 or len(frames[1]) != 8:
                # A truncated or foreign message: its seq is unknown, so fetch whatever the
                # publisher buffers after the last batch delivered (once per poll).
                self._bad_frame(
                    f"{len(frames)} frames"
                    + (f", seq frame of {len(frames[1])} bytes" if len(frames) == 3 else "")
                )
                if not replayed_for_bad_frame and self.next_seq is not None:
                    replayed_for_bad_frame = True
                    if not self._catch_up(self.next_seq, out):
                        self._schedule_full_resync()
                continue
            _, seq_b, payload = frames
            seq = int.from_bytes(seq_b, "big")
            last_live = self._last_live_seq
            self._last_live_seq = seq
            if last_live is not None and seq <= last_live:
                # The live stream went backwards: the engine (publisher) restarted.
                out.append(self._reset(f"engine restarted (seq {seq} after {last_live})"))
                self.next_seq = None
                if not self._catch_up(0, out):
                    self._schedule_full_resync()
                if self.next_seq is None or self.next_seq <= seq:
                    self._accept(seq, payload, out, live=True)
                continue
            if self.next_seq is None or seq == self.next_seq:
                self._accept(seq, payload, out, live=True)
            elif seq < self.next_seq:
                continue  # already delivered by a replay
            else:
                missing_from = self.next_seq
                self._gap(missing_from, seq, "live stream")
                if (
                    not self._catch_up(missing_from, out)
                    and self.next_seq is not None
                    and self.next_seq < seq
                ):
                    # Nothing filled it now: what follows goes onto a reset index, and a full
                    # resync is retried until the replay socket answers.
                    self._lose(self.next_seq, seq, out)
                    self._schedule_full_resync()
                if self.next_seq is None or self.next_seq <= seq:
                    self._accept(seq, payload, out, live=True)
        return out

    def close(self) -> None:
        try:
            self._sub.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(0)
        self._sub.close(0)
        if self._dealer is not None:
            self._dealer.close(0)
