"""The engine's API error table (tests/engine/server/test_error_table.py) through the router, in
front of a real engine: for every row of the generate routes the router's answer equals
the engine's — the same status, and the same error ``type``, ``param`` and ``code`` —
whether the router refuses the request itself (the fields it reads: n, max_tokens,
cache_salt, messages, prompt, the body) or passes the engine's answer on. The 200 rows
are answered 200 through the router too. A bad cache_salt gets the very same message:
both call kvmesh.common.cache_salt."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.conftest import RouterThread
from tests.engine.server.conftest import ThreadServer
from tests.engine.server.test_error_table import (
    BODY_LIMIT,
    CHAT,
    MODEL,
    ROWS,
    SERVER_ARGS,
    VOCAB,
    C,
    check_row,
    error_of,
    send,
)
from tests.tiny_models import build_tiny_model

GENERATE_ROWS = [r for r in ROWS if r.path in (C, CHAT)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = build_tiny_model(Path(tmp_path_factory.mktemp("tiny-llama")), "tiny-llama-plain")
    srv = ThreadServer(["--model", str(model), *SERVER_ARGS]).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def router(engine):
    from kvmesh.router.app import RouterConfig

    rt = RouterThread(
        RouterConfig(
            model=MODEL,
            tokenizer="smollm2-135m-instruct",
            redis_url=None,
            static_backends=[f"pod-0={engine.url}"],
            max_body_bytes=BODY_LIMIT,
            vocab_size=VOCAB,
            max_retries=0,
            refresh_interval=0.1,
        )
    )
    yield rt
    rt.stop()


@pytest.fixture(scope="module")
def http():
    with httpx.Client(timeout=60) as c:
        yield c


@pytest.mark.parametrize("row", GENERATE_ROWS, ids=[r.id for r in GENERATE_ROWS])
def test_router_answers_as_the_engine(engine, router, http, row):
    direct = send(engine.url, row, client=http)
    routed = send(router.url, row, client=http)
    check_row(direct, row)
    assert routed.status_code == direct.status_code, (row.id, routed.status_code, routed.text[:500])
    if row.status == 200:
        check_row(routed, row)
        return
    a, b = error_of(direct), error_of(routed)
    assert (b["type"], b["param"], b["code"]) == (a["type"], a["param"], a["code"]), (row.id, a, b)
    if (
        a["param"] == "cache_salt"
    ):  # one shared check (kvmesh.common.cache_salt): the same words too
        assert b["message"] == a["message"], (row.id, a, b)
