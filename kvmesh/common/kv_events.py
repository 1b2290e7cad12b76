"""Contract 2: KV-cache events, engine -> sidecar, in vLLM's wire format.

vLLM (``vllm/distributed/kv_events.py``) defines its events as msgspec Structs with
``array_like=True, omit_defaults=True`` and tagged by class name, so on the wire (msgpack):

    EventBatch    = [ts, [event, ...], data_parallel_rank]
    BlockStored   = ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                     lora_id, medium]
    BlockRemoved  = ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared = ["AllBlocksCleared"]

Block hashes are ints (uint64; our engine publishes contract-1 keys) or bytes (vLLM's
sha256 hashes). The decoder accepts missing trailing optional fields and ignores extra
trailing fields, so it reads older and newer vLLM versions too.

Transport (vLLM's ``ZmqEventPublisher``): a PUB socket sends multipart
``[topic, seq (8 bytes big-endian), payload]``; a ROUTER replay socket receives
``[client_id, b"", start_seq]`` from a DEALER and answers every buffered message with
``seq >= start_seq`` as ``[client_id, b"", seq, payload]``, then the end marker
``[client_id, b"", (-1 as 8 signed bytes), b""]``.

This module has the encoder and decoder, ``KVEventPublisher`` (used by the engine
server) and ``KVEventSubscriber`` (used by the sidecar: gap detection and replay).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Union

import msgpack
import zmq

log = logging.getLogger("kvmesh.kv_events")

BlockHash = Union[int, bytes]
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass
class BlockStored:
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None

    def to_wire(self) -> list[Any]:
        return ["BlockStored", list(self.block_hashes), self.parent_block_hash, list(self.token_ids),
                self.block_size, self.lora_id, self.medium]


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


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass
class EventBatch:
    ts: float
    events: list[KVEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None


class DecodeError(ValueError):
    pass


def encode_batch(events: Iterable[KVEvent], ts: float | None = None,
                 data_parallel_rank: int | None = None) -> bytes:
    """msgpack bytes of an EventBatch, byte-identical to vLLM's msgspec encoding."""
    wire = [time.time() if ts is None else float(ts), [e.to_wire() for e in events], data_parallel_rank]
    return msgpack.packb(wire, use_bin_type=True)


def _opt(items: list[Any], i: int) -> Any:
    return items[i] if len(items) > i else None


def _decode_event(item: Any) -> KVEvent | None:
    if isinstance(item, dict):  # tolerate a map-encoded event {"type": ..., fields...}
        tag = item.get("type")
        item = [tag] + [v for k, v in item.items() if k != "type"]
    if not isinstance(item, (list, tuple)) or not item:
        raise DecodeError(f"event is not a tagged array: {item!r}")
    tag = item[0]
    if isinstance(tag, bytes):
        tag = tag.decode()
    if tag == "BlockStored":
        if len(item) < 5:
            raise DecodeError(f"BlockStored needs 4 fields, got {len(item) - 1}")
        return BlockStored(list(item[1] or []), item[2], list(item[3] or []), int(item[4]),
                           _opt(item, 5), _opt(item, 6))
    if tag == "BlockRemoved":
        if len(item) < 2:
            raise DecodeError("BlockRemoved needs block_hashes")
        return BlockRemoved(list(item[1] or []), _opt(item, 2))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    log.debug("ignoring unknown KV event type %r", tag)
    return None


def decode_batch(payload: bytes) -> EventBatch:
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several types
        raise DecodeError(f"not msgpack: {exc}") from exc
    if not isinstance(raw, (list, tuple)) or len(raw) < 2:
        raise DecodeError(f"EventBatch must be an array [ts, events, ...], got {type(raw).__name__}")
    events = [e for e in (_decode_event(x) for x in (raw[1] or [])) if e is not None]
    return EventBatch(ts=float(raw[0]), events=events, data_parallel_rank=_opt(list(raw), 2))


class KVEventPublisher:
    """vLLM-compatible ZMQ publisher: PUB for live events plus a ROUTER replay socket.

    ``publish(events)`` is thread-safe. The replay buffer keeps the last
    ``buffer_steps`` batches; a background thread answers replay requests.
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000):
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
        self._closed = threading.Event()
        self._replay = None
        self.replay_endpoint: str | None = None
        self._thread: threading.Thread | None = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            try:
                self._replay.bind(replay_endpoint)
            except zmq.ZMQError:
                self._replay.close(0)
                self._pub.close(0)
                raise
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(target=self._serve_replay, name="kv-events-replay", daemon=True)
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
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        return seq

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
            if len(frames) != 3:
                log.warning("invalid replay request with %d frames", len(frames))
                continue
            client_id, _, start = frames
            start_seq = int.from_bytes(start, "big")
            with self._lock:
                items = [(s, p) for s, p in self._buffer if s >= start_seq]
            try:
                for seq, payload in items:
                    self._replay.send_multipart((client_id, b"", seq.to_bytes(8, "big"), payload))
                self._replay.send_multipart((client_id, b"", END_SEQ, b""))
            except zmq.ZMQError as exc:
                log.warning("replay send failed: %s", exc)

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        with self._lock:
            self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)


@dataclass
class Delivery:
    """What a subscriber hands its consumer: a batch in order, or a reset of all state."""

    seq: int | None
    batch: EventBatch | None = None
    reset: str | None = None  # reason; the consumer must drop everything it derived so far


class KVEventSubscriber:
    """SUB (+ DEALER replay) client with gap detection.

    ``poll()`` returns deliveries in sequence order. It handles:
      * a gap (seq jumps ahead): replay the missing range; if the publisher no longer
        buffers it, deliver a reset (the index would be wrong otherwise), then what is left;
      * a publisher restart (the live seq goes backwards): a reset, then a replay from 0;
      * ``request_resync()`` (e.g. the engine's process start time changed): same as restart.
    On the first poll it replays from 0 so a sidecar that starts after its engine catches up.
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 replay_timeout_s: float = 1.0):
        self._ctx = zmq.Context.instance()
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.replay_timeout_s = replay_timeout_s
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
        self._needs_catch_up = True
        self._resync_reason: str | None = None
        self.stats = {"batches": 0, "gaps": 0, "replays": 0, "resets": 0, "decode_errors": 0}

    # -- replay ---------------------------------------------------------------------------
    def _replay_from(self, start: int) -> list[tuple[int, bytes]] | None:
        """Buffered messages with seq >= start, or None if the replay socket did not answer."""
        if not self.replay_endpoint:
            return None
        self.stats["replays"] += 1
        if self._dealer is None:
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.connect(self.replay_endpoint)
        self._dealer.send_multipart((b"", start.to_bytes(8, "big")))
        out: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + self.replay_timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._dealer.poll(int(remaining * 1000) + 1):
                # No (complete) answer: drop the socket so a late answer cannot confuse the next one.
                self._dealer.close(0)
                self._dealer = None
                return None
            frames = self._dealer.recv_multipart()
            if len(frames) == 3:
                frames = frames[1:]
            if len(frames) != 2:
                continue
            seq_b, payload = frames
            if seq_b == END_SEQ:
                return out
            out.append((int.from_bytes(seq_b, "big"), payload))

    def request_resync(self, reason: str) -> None:
        self._resync_reason = reason

    def _decode(self, seq: int, payload: bytes) -> Delivery | None:
        try:
            batch = decode_batch(payload)
        except DecodeError as exc:
            self.stats["decode_errors"] += 1
            log.warning("dropping undecodable KV-event batch seq=%d: %s", seq, exc)
            return None
        self.stats["batches"] += 1
        return Delivery(seq=seq, batch=batch)

    def _reset(self, reason: str) -> Delivery:
        self.stats["resets"] += 1
        log.info("KV-event state reset: %s", reason)
        return Delivery(seq=None, reset=reason)

    def _catch_up(self, start: int, out: list[Delivery]) -> bool:
        """Replay from `start` into `out`; True if the range from `start` was complete."""
        items = self._replay_from(start)
        if items is None:
            return False
        complete = not items or items[0][0] == start
        if items and not complete and start > 0:
            out.append(self._reset(f"replay buffer no longer holds seq {start} (oldest {items[0][0]})"))
        for seq, payload in items:
            if self.next_seq is not None and seq < self.next_seq:
                continue
            d = self._decode(seq, payload)
            if d:
                out.append(d)
            self.next_seq = seq + 1
        return complete

    # -- main loop ------------------------------------------------------------------------
    def _check_connection(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self._was_disconnected = True
            elif event == zmq.EVENT_CONNECTED and self._was_disconnected:
                self._was_disconnected = False
                self.request_resync("reconnected to the engine's KV-event socket (engine restarted?)")

    def poll(self, timeout_ms: int = 100, max_messages: int = 1000) -> list[Delivery]:
        out: list[Delivery] = []
        self._check_connection()
        if self._resync_reason is not None:
            out.append(self._reset(self._resync_reason))
            self._resync_reason = None
            self.next_seq = None
            self._last_live_seq = None
            self._needs_catch_up = True
        if self._needs_catch_up:
            self._needs_catch_up = False
            self._catch_up(0, out)
        if not self._sub.poll(timeout_ms):
            self._check_connection()
            return out
        for _ in range(max_messages):
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 3:
                log.warning("ignoring KV-event message with %d frames", len(frames))
                continue
            _, seq_b, payload = frames
            seq = int.from_bytes(seq_b, "big")
            last_live = self._last_live_seq
            self._last_live_seq = seq
            if last_live is not None and seq <= last_live:
                # The live stream went backwards: the engine (publisher) restarted.
                out.append(self._reset(f"engine restarted (seq {seq} after {last_live})"))
                self.next_seq = None
                if not self._catch_up(0, out) or self.next_seq is None or self.next_seq <= seq:
                    d = self._decode(seq, payload)
                    if d:
                        out.append(d)
                    self.next_seq = seq + 1
                continue
            if self.next_seq is None or seq == self.next_seq:
                d = self._decode(seq, payload)
                if d:
                    out.append(d)
                self.next_seq = seq + 1
            elif seq < self.next_seq:
                continue  # already delivered by a replay
            else:
                self.stats["gaps"] += 1
                missing_from = self.next_seq
                log.info("KV-event gap: expected seq %d, got %d; replaying", missing_from, seq)
                if not self._catch_up(missing_from, out) and (self.next_seq or 0) == missing_from:
                    out.append(self._reset(f"seq {missing_from}..{seq - 1} lost and replay unavailable"))
                if self.next_seq is None or self.next_seq <= seq:
                    d = self._decode(seq, payload)
                    if d:
                        out.append(d)
                    self.next_seq = seq + 1
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
