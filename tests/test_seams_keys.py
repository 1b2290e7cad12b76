"""Seam: router <-> engine block keys, end to end (contract 1), property-based.

Random Unicode text (non-ASCII letters inside words, combining marks, emoji, CJK, odd spaces),
chat messages (content parts, null content, extra fields) and salted requests go through the
router (its tokenizer, chat template and key function: what it routes by) and through the real
engine (a tiny random-weight model with a real byte-level BPE tokenizer). For every request:

* the router's token count is the engine's ``usage.prompt_tokens``;
* the router's block keys are the keys of the engine's BlockStored events for that prompt (the
  chain walked back through the parents of earlier events where the prompt hit the cache), and
  the events' token ids are the router's tokens;
* the router's predicted cached tokens (from the pod's Redis block set, written by the real
  sidecar) equal the engine's ``usage.prompt_tokens_details.cached_tokens``, on the first send
  and on a repeat (everything cached).
"""

from __future__ import annotations

import logging
import threading

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvmesh.common.block_keys import block_keys
from kvmesh.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventSubscriber
from kvmesh.common.ports import free_port
from tests.conftest import RedisServer, RouterThread, wait_until
from tests.seams_support import build_seam_model, chain_errors, check_tokenizer_is_not_naive

MODEL = "seams-keys"
BS = 16
POD = "pod-0"


class EventLog:
    """Every KV event the engine publishes (a subscriber of its own, replaying from 0), with the
    parent of every key ever stored: enough to walk any stored chain back to its root."""

    def __init__(self, endpoint: str, replay: str):
        self.sub = KVEventSubscriber(endpoint, replay)
        self.events: list = []
        self.parent: dict[int, int | None] = {}
        self.tokens: dict[int, list[int]] = {}
        self.live: set[int] = set()
        self.next_seq: int | None = None
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for d in self.sub.poll(50):
                assert d.reset is None, d.reset
                with self.lock:
                    for ev in d.batch.events:
                        self.events.append(ev)
                        if isinstance(ev, BlockStored):
                            parent = ev.parent_block_hash
                            for i, h in enumerate(ev.block_hashes):
                                self.parent[h] = parent
                                self.tokens[h] = ev.token_ids[
                                    i * ev.block_size : (i + 1) * ev.block_size
                                ]
                                parent = h
                            self.live.update(ev.block_hashes)
                        elif isinstance(ev, BlockRemoved):
                            self.live.difference_update(ev.block_hashes)
                        elif isinstance(ev, AllBlocksCleared):
                            self.live.clear()
                    self.next_seq = self.sub.next_seq

    def chain(self, key: int) -> list[int]:
        """The stored chain ending at `key`, root first."""
        out = []
        k: int | None = key
        while k is not None:
            out.append(k)
            k = self.parent[k]
        return out[::-1]

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.sub.close()


class Mesh:
    """Engine (ThreadServer) + sidecar -> Redis + router, all real, on loopback."""

    def __init__(self, model_dir: str):
        from kvmesh.router.app import RouterConfig
        from kvmesh.sidecar.service import Sidecar, SidecarConfig
        from tests.engine.server.conftest import ThreadServer

        events, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        self.engine = ThreadServer(
            [
                "--model",
                model_dir,
                "--served-model-name",
                MODEL,
                "--num-kv-blocks",
                "4096",
                "--max-model-len",
                "2048",
                "--kv-events-endpoint",
                events,
                "--kv-events-replay-endpoint",
                replay,
            ]
        ).start()
        self.redis = RedisServer()
        self.log = EventLog(events, replay)
        self.sidecar = Sidecar(
            SidecarConfig(
                pod_name=POD,
                pod_url=self.engine.url,
                model=MODEL,
                engine_url=self.engine.url,
                kv_events_endpoint=events,
                kv_events_replay_endpoint=replay,
                redis_url=self.redis.url,
                block_size=BS,
                heartbeat_interval=0.2,
            )
        ).start()
        # the router loads the seam model's own tokenizer (not the shared smollm2 one)
        self.router_thread = RouterThread(
            RouterConfig(
                model=MODEL,
                tokenizer=model_dir,
                redis_url=self.redis.url,
                static_backends=[f"{POD}={self.engine.url}"],
                block_size=BS,
                refresh_interval=0.1,
            ),
            encoder=None,
        )
        self.router = self.router_thread.router
        self.url = self.router_thread.url
        self.http = httpx.Client(base_url=self.url, timeout=60)
        # The router's access log: its predicted cached tokens beside the engine's, per request.
        self.records: list[dict] = []
        access = logging.getLogger("kvmesh.router.access")
        self._handler = _Collect(self.records)
        access.addHandler(self._handler)
        access.setLevel(logging.INFO)
        wait_until(lambda: self.http.get("/ready").status_code == 200, 20, msg="router ready")
        wait_until(
            lambda: (
                self.router.discovery.pods.get(POD) is not None
                and self.router.discovery.pods[POD].has_blocks
            ),
            20,
            msg="router sees the pod",
        )

    def settled(self) -> None:
        """The engine's events so far are in the log and in Redis."""
        publisher = self.engine.state.engine.kv_publisher
        wait_until(
            lambda: (
                (self.log.next_seq or 0) == publisher.next_seq
                and (self.sidecar.indexed_seq or 0) == publisher.next_seq
            ),
            15,
            msg="events logged and indexed",
        )

    def send(self, path: str, body: dict) -> tuple[dict, dict]:
        """(the response's usage, the router's access-log fields for it)."""
        n = len(self.records)
        r = self.http.post(path, json=body)
        assert r.status_code == 200, r.text
        wait_until(lambda: len(self.records) > n, 10, msg="access log record")
        return r.json()["usage"], self.records[n]

    def close(self) -> None:
        logging.getLogger("kvmesh.router.access").removeHandler(self._handler)
        self.http.close()
        self.router_thread.stop()
        self.sidecar.stop(clean=True)
        self.log.close()
        self.engine.stop()
        self.redis.close()


class _Collect(logging.Handler):
    def __init__(self, into: list):
        super().__init__(logging.INFO)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "fields", None)
        if record.getMessage() == "request" and fields:
            self.into.append(dict(fields))


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    model_dir = build_seam_model(tmp_path_factory.mktemp("seams-keys-model"))
    check_tokenizer_is_not_naive(model_dir)
    m = Mesh(model_dir)
    yield m
    m.close()


# -- strategies ---------------------------------------------------------------------------------

_PIECES = st.sampled_from(
    [
        "naïve",
        " résumé",
        "café",
        "e\u0301",
        "n\u0303o",
        " Straße",
        "İstanbul",
        "ﬁne",
        " Ωmega",
        "über",
        "Ǆ",
        "👩\u200d👩\u200d👧",
        "🇫🇷",
        " 👍🏽",
        "日本語",
        " 中文",
        "٣٤٥",
        "½",
        "\u00a0",
        "\u2003",
        "\u200b",
        "x\u0300y",
        "\u3000",
        "—",
        "’s",
        " don't",
        "I'll",
        " 2024",
        "\r\n",
        "\t",
        "  ",
        "\n\n",
        "<|im_start|>",
        "<|im_end|>",
        " The quick brown fox jumps over the lazy dog.",
        " A KV cache keeps the keys and values of past tokens.",
    ]
)
_ANY = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12)
TEXT = (
    st.lists(st.one_of(_PIECES, _PIECES, _ANY), min_size=1, max_size=30).map("".join).filter(bool)
)
SALT = st.one_of(
    st.none(),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12),
)
CONTENT = st.one_of(
    TEXT,
    st.lists(TEXT.map(lambda t: {"type": "text", "text": t}), min_size=1, max_size=3),
    st.none(),
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": CONTENT},
    optional={"name": st.sampled_from(["ana", "bo"])},
)
CHAT = st.fixed_dictionaries(
    {"messages": st.lists(MESSAGE, min_size=1, max_size=3)},
    optional={"add_generation_prompt": st.booleans()},
)


def _body(kind: str, payload, salt):
    if kind == "completion":
        body = {"prompt": payload}
        path = "/v1/completions"
    else:
        body = dict(payload)
        path = "/v1/chat/completions"
    body.update(max_tokens=1, temperature=0)
    if salt is not None:
        body["cache_salt"] = salt
    return path, body


def check_one(mesh: Mesh, path: str, body: dict) -> None:
    tokens, keys = mesh.router.prompt_tokens.tokens_and_keys(path, body, False, False)
    assert tokens, "the router could not tokenize a request the engine serves"
    assert keys == block_keys(tokens, MODEL, BS, cache_salt=body.get("cache_salt"))
    mesh.settled()
    with mesh.log.lock:
        mark = len(mesh.log.events)
    usage, rec = mesh.send(path, body)
    assert usage["prompt_tokens"] == len(tokens), (
        "router and engine tokenized the prompt differently"
    )
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert rec["prompt_tokens"] == len(tokens) and rec["cached_tokens"] == cached
    assert rec["predicted_cached_tokens"] == cached, (rec, len(tokens))
    mesh.settled()
    with mesh.log.lock:
        new = [e for e in mesh.log.events[mark:] if isinstance(e, BlockStored)]
        assert chain_errors(new, MODEL, BS, body.get("cache_salt")) == []
        stored = [h for e in new for h in e.block_hashes]
        if stored:  # the engine's chain for this prompt: what it hit, then what it stored
            engine_keys = (
                mesh.log.chain(new[0].parent_block_hash)
                if new[0].parent_block_hash is not None
                else []
            )
            engine_keys += stored
        elif keys:  # a full hit: the chain the engine stored before, ending at the last key
            engine_keys = mesh.log.chain(keys[-1]) if keys[-1] in mesh.log.parent else []
        else:
            engine_keys = []
        assert engine_keys == keys
        for i, k in enumerate(keys):  # the engine's token ids of every block are the router's
            assert mesh.log.tokens[k] == tokens[i * BS : (i + 1) * BS]
        assert set(keys) <= mesh.log.live
    # Again: everything is cached now; the engine still computes the last token.
    usage, rec = mesh.send(path, body)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached == (len(tokens) - 1) // BS * BS
    assert rec["predicted_cached_tokens"] == cached, (rec, len(tokens))


@settings(max_examples=35, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=TEXT, salt=SALT)
@example(text="naïve résumé " * 8, salt=None)
@example(text="Straße über café — 日本語 👩\u200d👩\u200d👧 " * 4, salt="tenant-a")
@example(
    text="x" * 160, salt=None
)  # a prompt of exactly 10 full blocks (the last one is recomputed)
def test_completion_keys_agree(mesh, text, salt):
    check_one(mesh, *_body("completion", text, salt))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chat=CHAT, salt=SALT)
@example(
    chat={
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "naïve "},
                    {"type": "text", "text": "résumé " * 6},
                ],
            }
        ]
    },
    salt=None,
)
@example(
    chat={
        "messages": [
            {"role": "system", "content": None},
            {"role": "user", "content": "Héllo ☃ " * 6},
        ]
    },
    salt="s",
)
def test_chat_keys_agree(mesh, chat, salt):
    check_one(mesh, *_body("chat", chat, salt))


def test_salts_and_models_never_share_keys(mesh):
    """The same text under two salts (or none) gives disjoint key chains in the engine too: a
    salted request never hits another tenant's blocks."""
    text = "A shared system prompt that two tenants both send, word for word. " * 3
    usage = {}
    for salt in (None, "tenant-a", "tenant-b"):
        path, body = _body("completion", text, salt)
        usage[salt], _ = mesh.send(path, body)
    assert all(u["prompt_tokens_details"]["cached_tokens"] == 0 for u in usage.values())
    tokens = mesh.router.prompt_tokens.tokens_and_keys(
        "/v1/completions", {"prompt": text}, False, False
    )[0]
    chains = [
        set(block_keys(tokens, MODEL, BS, cache_salt=s)) for s in (None, "tenant-a", "tenant-b")
    ]
    assert not (chains[0] & chains[1] or chains[0] & chains[2] or chains[1] & chains[2])
    mesh.settled()
    assert all(c <= mesh.log.live for c in chains)
