"""API fuzzing of one engine replica (`kvmesh serve` on a tiny random model) with schemathesis:
bodies generated from the engine's own OpenAPI document (kvmesh.common.openapi), sent over real
HTTP; no 5xx, no hang, every response as documented (see tests/fuzz_checks.py)."""

from __future__ import annotations

import json

import pytest
import schemathesis

from tests.engine.server.conftest import ThreadServer
from tests.fuzz_checks import (
    check_unsupported_methods,
    config,
    documented_examples,
    fuzz,
    send_example,
)

KEY = "fuzz-key"
MODEL = "tiny-fuzz"
AUTH = {"Authorization": f"Bearer {KEY}"}
OPERATIONS = [
    ("post", "/v1/completions"),
    ("post", "/v1/chat/completions"),
    ("post", "/tokenize"),
    ("post", "/detokenize"),
    ("get", "/v1/models"),
    ("get", "/health"),
    ("get", "/ready"),
    ("get", "/load"),
    ("get", "/metrics"),
]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    # Every generated request stays cheap: a short context, a default of 4 new tokens for a
    # request that leaves max_tokens out, a small admission bound.
    # One torch thread: a tiny model gains nothing from two, and on a machine busy with other
    # processes two spin-waiting threads make each step ~20x slower. Restored afterwards.
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    gen = tmp_path_factory.mktemp("generation-config")
    (gen / "generation_config.json").write_text(json.dumps({"max_new_tokens": 4}))
    srv = ThreadServer(
        [
            "--model",
            tiny_model,
            "--served-model-name",
            MODEL,
            "--num-kv-blocks",
            "64",
            "--max-model-len",
            "64",
            "--max-num-seqs",
            "4",
            "--max-waiting",
            "4",
            "--max-num-batched-tokens",
            "256",
            "--generation-config",
            str(gen),
            "--api-key",
            KEY,
            "--max-body-bytes",
            "16384",
        ]
    ).start()
    yield srv
    srv.stop()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def engine_schema(server):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json", config=config())


def test_document_covers_every_route(engine_schema):
    ops = {
        (op.method.lower(), op.path) for op in (r.ok() for r in engine_schema.get_all_operations())
    }
    assert ops == set(OPERATIONS)
    body = engine_schema.raw_schema["components"]["schemas"]["CompletionRequest"]
    assert body["properties"]["model"]["enum"] == [MODEL, None]
    assert (
        body["properties"]["prompt"]["anyOf"][1]["items"]["maximum"] == 49151
    )  # the vocabulary, once loaded


def test_documented_examples(engine_schema):
    """Every request example of the document is answered 200, as documented (streams included)."""
    examples = documented_examples(engine_schema)
    assert len(examples) >= 10
    streamed = 0
    for method, path, name, body in examples:
        r = send_example(engine_schema, method, path, body, AUTH)
        assert r.status_code == 200, (path, name, r.text)
        streamed += r.headers["content-type"][0].startswith("text/event-stream")
    assert streamed == 2


def test_unsupported_methods_are_405_with_allow(server, engine_schema):
    """Found by schemathesis' unsupported-method check: a 405 came without its Allow header (the
    error handler dropped the exception's headers)."""
    assert check_unsupported_methods(server.url, engine_schema, AUTH) >= 30


@pytest.mark.parametrize("method,path", OPERATIONS)
def test_fuzz_engine_api(engine_schema, method, path):
    fuzz(engine_schema, method, path, AUTH)


def _documented(schema: dict) -> set[str]:
    props = set(schema.get("properties") or {})
    for branch in schema.get("oneOf", []):
        props |= set(branch.get("properties") or {})
    return props


@pytest.mark.parametrize(
    "name",
    [
        "CompletionRequest",
        "ChatCompletionRequest",
        "TokenizeRequest",
        "DetokenizeRequest",
        "ChatMessage",
    ],
)
def test_document_names_every_field_the_engine_reads(name):
    """The document's request schemas (derived from kvmesh.common.protocol) name exactly the fields
    of the engine's request models (its subclasses of them)."""
    from kvmesh.common import protocol as shared
    from kvmesh.common.openapi import request_schemas
    from kvmesh.engine.server import protocol

    fields = set(getattr(protocol, name, getattr(shared, name)).model_fields)
    documented = _documented(request_schemas()[name])
    if (
        name == "ChatMessage"
    ):  # extra fields of a message go to the chat template: `name` is documented
        documented -= {"name"}
    assert documented == fields
