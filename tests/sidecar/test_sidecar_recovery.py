"""The sidecar through engine restarts and KV-event floods.

* A real engine (`kvmesh serve`, tiny random model) is SIGKILLed and restarted, then SIGTERMed
  (it drains) and restarted: each time the sidecar's heartbeat says `ready` again within a few
  seconds of the new engine's `/ready` answering 200, and the pod's block set in Redis is the new
  engine's (the old incarnation's keys are gone).
* The heartbeat's state is the engine's readiness now, not a latched one.
* A replay flood through the real ZeroMQ sockets (more batches than ZeroMQ's default high-water
  mark of 1,000): the index ends equal to what was published, the gap metrics count what had to
  be healed, and nothing is lost in silence; a range the engine no longer buffers is healed from
  its block-set snapshot, and with a publisher that has none the loss is counted, not silent.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

import httpx
import pytest

from kvmesh.common import kv_events as kv
from kvmesh.common import redis_layout as rl
from kvmesh.common.block_keys import block_keys, key_hex
from kvmesh.common.engine_load import parse_prometheus
from kvmesh.common.ports import free_port
from kvmesh.sidecar.service import Sidecar, SidecarConfig
from tests.conftest import ROOT, child_env, wait_until

BS = 16
HEARTBEAT_S = 0.25
READY_BOUND_S = 5.0  # heartbeat `ready` at most this long after the engine's /ready says 200


# -- a real engine, restarted ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from tests.tiny_models import build_tiny_model

    return str(build_tiny_model(Path(tmp_path_factory.mktemp("tiny-llama")), "tiny-llama-plain"))


class EngineProc:
    """`kvmesh serve` as a process on fixed ports, so it can be killed and started again."""

    def __init__(self, model_dir: str, served_name: str):
        self.port, self.events_port, self.replay_port = free_port(), free_port(), free_port()
        self.argv = [
            sys.executable,
            "-P",
            "-m",
            "kvmesh.cli",
            "serve",
            "--model",
            model_dir,
            "--served-model-name",
            served_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--num-kv-blocks",
            "64",
            "--max-model-len",
            "256",
            "--drain-timeout",
            "5",
            "--kv-events-endpoint",
            self.events_endpoint,
            "--kv-events-replay-endpoint",
            self.replay_endpoint,
            "--log-level",
            "warning",
        ]
        self.proc: subprocess.Popen | None = None

    url = property(lambda self: f"http://127.0.0.1:{self.port}")
    events_endpoint = property(lambda self: f"tcp://127.0.0.1:{self.events_port}")
    replay_endpoint = property(lambda self: f"tcp://127.0.0.1:{self.replay_port}")

    def start(self) -> EngineProc:
        # The model's speed is not under test: plain torch ops, no wait for a CPU-kernel build.
        self.proc = subprocess.Popen(
            self.argv, env={**child_env(), "KVMESH_CPU_KERNELS": "0"}, cwd=ROOT
        )
        return self

    def ready(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, "the engine exited"
        try:
            return httpx.get(self.url + "/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self) -> float:
        """Blocks until /ready answers 200; returns the monotonic time it first did."""
        wait_until(self.ready, 180, interval=0.05, msg="engine /ready 200")
        return time.monotonic()

    def stop(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        self.proc.wait(60)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _complete(engine: EngineProc, prompt: list[int]) -> None:
    r = httpx.post(
        engine.url + "/v1/completions",
        timeout=60,
        json={"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text


def _prompt(first: int, n_blocks: int = 5) -> list[int]:
    return [first + i for i in range(n_blocks * BS)]


def test_engine_restarts_after_sigkill_and_sigterm_are_ready_again_with_the_new_block_set(
    tiny_model, redis_server, model_name
):
    engine = EngineProc(tiny_model, model_name)
    r = redis_server.client()
    hb_key, bkey = rl.heartbeat_key(model_name, "pod-a"), rl.blocks_key(model_name, "pod-a")
    sidecar = None
    try:
        engine.start().wait_ready()
        sidecar = Sidecar(
            SidecarConfig(
                pod_name="pod-a",
                pod_url=engine.url,
                model=model_name,
                engine_url=engine.url,
                kv_events_endpoint=engine.events_endpoint,
                kv_events_replay_endpoint=engine.replay_endpoint,
                redis_url=redis_server.url,
                heartbeat_interval=HEARTBEAT_S,
                block_size=BS,
            )
        ).start()
        prompt = _prompt(100)
        _complete(engine, prompt)
        old_keys = {key_hex(k) for k in block_keys(prompt, model_name, BS)}
        wait_until(
            lambda: r.smembers(bkey) == old_keys, 10, msg="the first engine's blocks in Redis"
        )
        wait_until(lambda: r.hget(hb_key, "state") == "ready", 5, msg="heartbeat ready")

        for round_, sig in enumerate((signal.SIGKILL, signal.SIGTERM)):
            engine.stop(sig)
            engine.start()
            ready_at = engine.wait_ready()
            # Ready again within the bound of the engine's own /ready, however long it loaded.
            wait_until(
                lambda: r.hget(hb_key, "state") == "ready",
                READY_BOUND_S,
                msg=f"heartbeat ready after the engine's restart (signal {sig.name})",
            )
            assert time.monotonic() - ready_at <= READY_BOUND_S
            # The old incarnation's blocks are gone: the new engine holds none yet.
            wait_until(lambda: r.scard(bkey) == 0, READY_BOUND_S, msg="old blocks removed")
            prompt = _prompt(1000 + 500 * round_)
            _complete(engine, prompt)
            new_keys = {key_hex(k) for k in block_keys(prompt, model_name, BS)}
            assert not new_keys & old_keys
            wait_until(
                lambda: r.smembers(bkey) == new_keys, 10, msg="exactly the new engine's blocks"
            )
            hb = rl.Heartbeat.from_mapping("pod-a", r.hgetall(hb_key))
            assert hb.state == "ready" and hb.url == engine.url
            old_keys = new_keys
        # One restart per new incarnation (its comeback or its new start time, never both).
        assert sidecar.stats["engine_restarts"] == 2
    finally:
        if sidecar is not None:
            sidecar.stop()
        engine.kill()


# -- readiness now, not latched (stub engine: fast) ------------------------------------------


def test_heartbeat_follows_the_engines_current_readiness(redis_server, stub_factory, model_name):
    (stub,) = stub_factory(model_name, 1)
    r = redis_server.client()
    hb_key = rl.heartbeat_key(model_name, "pod-a")
    sidecar = Sidecar(
        SidecarConfig(
            pod_name="pod-a",
            pod_url=stub.url,
            model=model_name,
            engine_url=stub.url,
            kv_events_endpoint=stub.events_endpoint,
            kv_events_replay_endpoint=stub.replay_endpoint,
            redis_url=redis_server.url,
            heartbeat_interval=0.1,
        )
    ).start()
    try:
        wait_until(lambda: r.hget(hb_key, "state") == "ready", 5, msg="ready")
        for _ in range(2):  # a drain that ends (the engine is ready again) is not a lasting state
            stub.config(draining=True)
            wait_until(lambda: r.hget(hb_key, "state") == "draining", 5, msg="draining")
            stub.config(draining=False)
            wait_until(lambda: r.hget(hb_key, "state") == "ready", 2, msg="ready again")
        # The sidecar's own shutdown is the one lasting drain: the engine's readiness does not undo it.
        sidecar.mark_draining()
        time.sleep(0.5)
        assert r.hget(hb_key, "state") == "draining" and sidecar.heartbeat.state == "draining"
    finally:
        sidecar.stop()


# -- floods and gaps through the real ZeroMQ sockets -------------------------------------------


class DroppingSocket:
    """The publisher's PUB socket, with a switch that drops what is sent (a live stream that loses
    messages: a slow subscriber over its high-water mark, a network blip)."""

    def __init__(self, sock):
        self._sock = sock
        self.drop = False

    def send_multipart(self, frames, *args, **kw):
        if not self.drop:
            return self._sock.send_multipart(frames, *args, **kw)

    def __getattr__(self, name):
        return getattr(self._sock, name)


class Truth:
    """What the engine's cache holds according to everything published (independent of the code
    under test): keys stored minus keys removed."""

    def __init__(self, model: str):
        self.model = model
        self.keys: set[int] = set()
        self.stored_order: deque[int] = deque()
        self.next_token = 0

    def batch(self, i: int, blocks: int = 4) -> list[kv.KVEvent]:
        tokens = list(range(self.next_token, self.next_token + blocks * BS))
        self.next_token += blocks * BS
        keys = block_keys(tokens, self.model, BS)
        events: list[kv.KVEvent] = [kv.BlockStored(keys, None, tokens, BS, None, None)]
        self.keys.update(keys)
        self.stored_order.extend(keys)
        if (
            i % 5 == 4
        ):  # some evictions (the oldest): the index must follow removals through a gap too
            gone = [self.stored_order.popleft() for _ in range(3)]
            events.append(kv.BlockRemoved(gone, None))
            self.keys.difference_update(gone)
        return events

    def hex(self) -> set[str]:
        return {key_hex(k) for k in self.keys}


def _metric(text: str, name: str) -> float:
    return sum(v for n, _, v in parse_prometheus(text) if n == name)


@pytest.fixture
def flood_rig(redis_server, model_name):
    made: list = []

    def start(buffer_steps: int = 10_000, snapshots: bool = True):
        pub = kv.KVEventPublisher(
            "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=buffer_steps, snapshots=snapshots
        )
        made.append(pub)
        pub._pub = DroppingSocket(pub._pub)
        sc = Sidecar(
            SidecarConfig(
                pod_name="pod-a",
                pod_url="http://127.0.0.1:1",
                model=model_name,
                engine_url="http://127.0.0.1:1",
                kv_events_endpoint=pub.endpoint,
                kv_events_replay_endpoint=pub.replay_endpoint,
                redis_url=redis_server.url,
                heartbeat_interval=5,
                block_size=BS,
            )
        )
        made.append(sc.start())
        return pub, sc

    yield start
    for thing in reversed(made):
        (thing.stop if isinstance(thing, Sidecar) else thing.close)()


def _live(pub, sc, truth, r, bkey) -> None:
    """Publish until the sidecar indexes a batch: its SUB socket is connected."""
    for i in range(200):
        pub.publish(truth.batch(i))
        try:
            wait_until(lambda: r.smembers(bkey) == truth.hex(), 0.2)
            return
        except AssertionError:
            continue
    raise AssertionError("the sidecar never indexed a live batch")


def test_a_replay_flood_leaves_the_index_equal_to_the_engines_blocks(
    flood_rig, redis_server, model_name
):
    """The live stream loses `flood` batches (more than ZeroMQ's default HWM of 1,000); the next live
    batch shows the gap and the sidecar replays all of it through the replay socket at once."""
    flood = 9_000
    pub, sc = flood_rig()
    r = redis_server.client()
    bkey = rl.blocks_key(model_name, "pod-a")
    truth = Truth(model_name)
    _live(pub, sc, truth, r, bkey)
    gaps_before = sc.events.subscriber.stats["gap_batches"]
    pub._pub.drop = True
    for i in range(flood):
        pub.publish(truth.batch(i))
    pub._pub.drop = False
    pub.publish(truth.batch(flood))
    wait_until(lambda: r.scard(bkey) == len(truth.keys), 30, msg="the whole flood indexed")
    assert r.smembers(bkey) == truth.hex()
    assert {key_hex(k) for k in sc.writer.index.keys()} == truth.hex()
    stats = sc.events.subscriber.stats
    # The live gap (and any hole a replay answer had) was counted and healed by replay alone.
    assert stats["gap_batches"] - gaps_before >= flood
    assert stats["gap_resets"] == 0 and stats["snapshots"] == 0 and stats["lost_batches"] == 0
    text = sc.metrics_text()
    assert _metric(text, "kvmesh_sidecar_kv_event_gaps_total") >= 1
    assert _metric(text, "kvmesh_sidecar_kv_event_gap_batches_total") >= flood
    assert _metric(text, "kvmesh_sidecar_kv_event_gap_resets_total") == 0


def test_a_gap_beyond_the_replay_buffer_is_healed_from_the_snapshot(
    flood_rig, redis_server, model_name
):
    pub, sc = flood_rig(buffer_steps=500)
    r = redis_server.client()
    bkey = rl.blocks_key(model_name, "pod-a")
    truth = Truth(model_name)
    _live(pub, sc, truth, r, bkey)
    pub._pub.drop = True
    for i in range(2_000):  # 4x what the buffer keeps
        pub.publish(truth.batch(i))
    pub._pub.drop = False
    pub.publish(truth.batch(2_000))
    wait_until(
        lambda: r.smembers(bkey) == truth.hex(), 30, msg="index equal to the engine's blocks"
    )
    stats = sc.events.subscriber.stats
    assert stats["snapshots"] == 1 and stats["gap_resets"] == 0 and stats["gap_batches"] >= 2_000
    assert _metric(sc.metrics_text(), "kvmesh_sidecar_kv_event_snapshots_total") == 1
    # And the stream goes on from the snapshot.
    pub.publish(truth.batch(2_001))
    wait_until(lambda: r.smembers(bkey) == truth.hex(), 5, msg="live after the snapshot")


def test_without_snapshots_a_gap_beyond_the_buffer_is_counted_never_silent(
    flood_rig, redis_server, model_name
):
    """A publisher like vLLM's (no snapshot): the range it no longer buffers cannot be healed; the
    sidecar resets and keeps what the buffer still has, and says so in its metrics."""
    pub, sc = flood_rig(buffer_steps=500, snapshots=False)
    r = redis_server.client()
    bkey = rl.blocks_key(model_name, "pod-a")
    truth = Truth(model_name)
    _live(pub, sc, truth, r, bkey)
    pub._pub.drop = True
    for i in range(2_000):
        pub.publish(truth.batch(i))
    pub._pub.drop = False
    pub.publish(truth.batch(2_000))
    wait_until(lambda: sc.events.subscriber.stats["gap_resets"] == 1, 30, msg="the loss counted")
    wait_until(
        lambda: r.smembers(bkey) and r.smembers(bkey) <= truth.hex(),
        10,
        msg="a subset, nothing stale",
    )
    assert _metric(sc.metrics_text(), "kvmesh_sidecar_kv_event_gap_resets_total") == 1


def test_the_replay_socket_never_drops_an_answer_to_a_slow_reader():
    """10,000 batches of ~2 KB to a DEALER that holds one message at a time and reads slowly: every
    one arrives, in order (ZeroMQ's ROUTER drops over its send HWM unless told not to)."""
    import zmq

    pub = kv.KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", snapshots=False)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        tokens = list(range(40_000, 40_000 + 32 * BS))
        for i in range(10_000):
            pub.publish([kv.BlockStored([i], None, tokens, BS)])
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 1)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs = []
        time.sleep(1.0)  # the answer piles up against the reader
        while True:
            assert dealer.poll(15_000), f"the answer stopped after {len(seqs)} batches"
            frames = dealer.recv_multipart()
            if frames[1] == kv.END_SEQ:
                break
            seqs.append(int.from_bytes(frames[1], "big"))
        assert seqs == list(range(10_000))
    finally:
        dealer.close(0)
        pub.close()


def test_a_hole_in_a_replay_answer_is_a_gap_asked_for_again():
    """A replay answer that skips a seq (what a replay socket over its HWM sends) is detected and the
    missing batch fetched again; the old subscriber took the next seq it got as the next one."""
    import zmq

    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:*")
    pub = kv.KVEventPublisher("tcp://127.0.0.1:*", None)
    sub = kv.KVEventSubscriber(pub.endpoint, router.getsockopt_string(zmq.LAST_ENDPOINT))
    batches = {s: kv.encode_batch([kv.BlockRemoved([s])]) for s in range(6)}
    asked: list[int] = []

    def serve(answer_seqs):
        assert router.poll(5000)
        client, _, start = router.recv_multipart()
        asked.append(int.from_bytes(start, "big"))
        for s in answer_seqs:
            router.send_multipart([client, b"", s.to_bytes(8, "big"), batches[s]])
        router.send_multipart([client, b"", kv.END_SEQ, b""])

    import threading

    server = threading.Thread(target=lambda: (serve([0, 1, 3, 4, 5]), serve([2, 3, 4, 5])))
    server.start()
    try:
        got = []
        for _ in range(10):
            got.extend(sub.poll(50))
            if len(got) >= 6:
                break
        server.join(5)
        assert [d.seq for d in got] == [0, 1, 2, 3, 4, 5] and not any(d.reset for d in got)
        assert asked == [0, 2]
        assert (
            sub.stats["gaps"] == 1
            and sub.stats["gap_batches"] == 1
            and sub.stats["gap_resets"] == 0
        )
    finally:
        sub.close()
        pub.close()
        router.close(0)


def test_the_snapshot_is_the_published_block_set_parents_first():
    """What the publisher keeps for snapshots follows stores, removals and clears; a parent stored
    again after its child still comes first (a subscriber deriving keys from parents needs it)."""
    s = kv.PublishedBlockSet()
    tok = list(range(100, 100 + 3 * BS))
    s.apply(
        [kv.BlockStored([1, 2], None, tok[: 2 * BS], BS), kv.BlockStored([3], 2, tok[2 * BS :], BS)]
    )
    s.apply([kv.BlockStored([9], None, tok[:BS], BS, None, "CPU"), kv.BlockRemoved([1])])
    s.apply([kv.BlockStored([1], None, tok[:BS], BS)])
    events = kv.PublishedBlockSet.snapshot_events(s.copy())
    assert isinstance(events[0], kv.AllBlocksCleared)
    got = {(e.block_hashes[0], e.medium): e for e in events[1:]}
    assert set(got) == {(1, None), (2, None), (3, None), (9, "CPU")}
    order = [e.block_hashes[0] for e in events[1:] if e.medium is None]
    assert order == [1, 2, 3]
    assert got[(2, None)].parent_block_hash == 1 and got[(2, None)].token_ids == tok[BS : 2 * BS]
    assert got[(3, None)].parent_block_hash == 2 and got[(3, None)].token_ids == tok[2 * BS :]
    s.apply([kv.AllBlocksCleared()])
    assert kv.PublishedBlockSet.snapshot_events(s.copy()) == [kv.AllBlocksCleared()]


def test_a_replay_socket_that_did_not_answer_is_asked_again_for_a_full_resync():
    """The first catch-up finds no replay socket (the engine binds it late, or it restarts): the
    batches published before the SUB connected are missing. The subscriber asks again, with a
    backoff, and once the socket answers it rebuilds from seq 0: nothing stays missing."""
    import threading

    import zmq

    pub = kv.KVEventPublisher("tcp://127.0.0.1:*", None)
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    sub = kv.KVEventSubscriber(pub.endpoint, replay_endpoint, replay_timeout_s=0.2)
    router = None
    try:
        pub.publish(
            [kv.BlockRemoved([0])]
        )  # before the subscriber's SUB is connected: not seen live
        got = sub.poll(50)  # the first catch-up: nobody answers
        assert sub.stats["replay_failures"] == 1 and sub.caught_up
        live_seen = []
        for i in range(100):  # the SUB connects; batches from then on arrive live
            pub.publish([kv.BlockRemoved([i + 1])])
            live_seen = [d.seq for d in sub.poll(50) if d.batch is not None]
            if live_seen:
                break
        assert live_seen and 0 not in live_seen
        # The replay socket comes up and answers from the publisher's buffer.
        router = zmq.Context.instance().socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(replay_endpoint)

        def serve():
            assert router.poll(10_000)
            client, _, start = router.recv_multipart()
            for seq, payload in list(pub._buffer):
                if seq >= int.from_bytes(start, "big"):
                    router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
            router.send_multipart([client, b"", kv.END_SEQ, b""])

        server = threading.Thread(target=serve)
        server.start()
        got = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(d.seq == 0 for d in got):
            got.extend(sub.poll(50))
        server.join(5)
        assert any(d.reset for d in got), "the full resync starts with a reset"
        after_reset = [d.seq for d in got[max(i for i, d in enumerate(got) if d.reset) + 1 :]]
        assert after_reset[: pub.next_seq] == list(range(pub.next_seq))
    finally:
        sub.close()
        pub.close()
        if router is not None:
            router.close(0)
