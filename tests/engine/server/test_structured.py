"""Structured outputs through real HTTP on loopback, on a tiny random-weight model (only the grammar
can make its output valid): the openai client's ``beta.chat.completions.parse`` with a pydantic
model, streaming and not; every request field (response_format, structured_outputs, guided_*) on
both endpoints, streamed and whole, n > 1, in both engine modes (a core process receives the spec
over its socket); a grammar that does not compile in time is refused alone. The error table for bad
specs is in test_error_table.py."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from kvmesh.engine.structured import compiler
from kvmesh.engine.structured.backend import backend_for
from kvmesh_testing.core_hooks import HookedCoreLoop
from tests.engine.server.conftest import ThreadServer

MODEL = "tiny"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
REGEX = r"[a-z]{2,6}@[a-z]{2,4}\.(com|org)"


class Person(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=120)
    kind: Literal["a", "b"]


def _server(tiny_model: str, mode: str) -> ThreadServer:
    return ThreadServer(
        [
            "--model",
            tiny_model,
            "--served-model-name",
            MODEL,
            "--num-kv-blocks",
            "128",
            "--max-num-seqs",
            "8",
            "--engine-mode",
            mode,
        ],
        core_loop=HookedCoreLoop,
    ).start()


@pytest.fixture(scope="module", params=["thread", "process"])
def server(request, tiny_model):
    srv = _server(tiny_model, request.param)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(api_key="none", base_url=server.url + "/v1", max_retries=0) as c:
        yield c


def test_openai_parse_with_a_pydantic_model(client):
    done = client.beta.chat.completions.parse(
        model=MODEL, messages=MESSAGES, response_format=Person, max_tokens=64, temperature=0
    )
    choice = done.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Person)
    sampled = client.beta.chat.completions.parse(
        model=MODEL,
        messages=MESSAGES,
        response_format=Person,
        max_tokens=64,
        temperature=1.0,
        seed=4,
        n=2,
    )
    assert len(sampled.choices) == 2 and all(
        isinstance(c.message.parsed, Person) for c in sampled.choices
    )


def test_openai_parse_streaming(client):
    deltas = []
    with client.beta.chat.completions.stream(
        model=MODEL, messages=MESSAGES, response_format=Person, max_tokens=64, temperature=0
    ) as stream:
        for event in stream:
            if event.type == "content.delta":
                deltas.append(event.delta)
        final = stream.get_final_completion()
    assert len(deltas) > 1  # streamed in pieces
    parsed = final.choices[0].message.parsed
    assert isinstance(parsed, Person) and Person.model_validate_json("".join(deltas)) == parsed


def _post(server, path, body):
    r = httpx.post(
        server.url + path,
        json={"model": MODEL, "max_tokens": 48, "temperature": 0, **body},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def _streamed_texts(server, path, body) -> dict[int, str]:
    texts: dict[int, str] = {}
    with httpx.stream(
        "POST",
        server.url + path,
        json={"model": MODEL, "max_tokens": 48, "temperature": 0, "stream": True, **body},
        timeout=120,
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                piece = c["text"] if "text" in c else (c["delta"].get("content") or "")
                texts[c["index"]] = texts.get(c["index"], "") + piece
    return texts


FIELDS = [
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": PERSON, "strict": True},
            }
        },
        lambda t: jsonschema.validate(json.loads(t), PERSON),
    ),
    (
        {"structured_outputs": {"json": PERSON}},
        lambda t: jsonschema.validate(json.loads(t), PERSON),
    ),
    ({"guided_json": json.dumps(PERSON)}, lambda t: jsonschema.validate(json.loads(t), PERSON)),
    ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
    ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
    (
        {"structured_outputs": {"choice": ["left", "right"]}},
        lambda t: t in ("left", "right") or pytest.fail(t),
    ),
    ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down") or pytest.fail(t)),
    (
        {"structured_outputs": {"grammar": 'root ::= "(" [0-9] ("," [0-9])? ")"'}},
        lambda t: re.fullmatch(r"\([0-9](,[0-9])?\)", t) or pytest.fail(t),
    ),
    ({"guided_grammar": 'root ::= "x" | "yy"'}, lambda t: t in ("x", "yy") or pytest.fail(t)),
]


@pytest.mark.parametrize(
    "fields, valid", FIELDS, ids=[next(iter(f)) + "-" + str(i) for i, (f, _) in enumerate(FIELDS)]
)
def test_every_field_on_both_endpoints(server, fields, valid):
    chat = _post(server, "/v1/chat/completions", {"messages": MESSAGES, **fields})
    valid(chat["choices"][0]["message"]["content"])
    assert chat["choices"][0]["finish_reason"] == "stop"
    done = _post(
        server,
        "/v1/completions",
        {"prompt": "Name: ", "n": 2, "temperature": 1.0, "seed": 1, **fields},
    )
    assert len(done["choices"]) == 2
    for c in done["choices"]:
        valid(c["text"])
    streamed = _streamed_texts(server, "/v1/completions", {"prompt": "Name: ", **fields})
    valid(streamed[0])


def test_json_object_mode_streams_a_valid_prefix(server):
    """Free-form JSON on a random model may run to max_tokens; what it wrote is on the grammar."""
    texts = _streamed_texts(
        server,
        "/v1/chat/completions",
        {"messages": MESSAGES, "response_format": {"type": "json_object"}, "max_tokens": 24},
    )
    assert texts[0].startswith("{")


def test_slow_grammar_is_refused_alone(server, monkeypatch):
    if server.state.engine.mode != "thread":
        pytest.skip("the check runs in the API process: one mode is enough")
    release = threading.Event()
    real = compiler.compile_spec

    def stuck(comp, spec):
        if spec.regex == "stuck+":
            release.wait(30)
        return real(comp, spec)

    monkeypatch.setattr(compiler, "compile_spec", stuck)
    engine = server.state.engine
    monkeypatch.setattr(
        backend_for(engine.model_dir, engine.limits.vocab_size).cache, "timeout_s", 0.5
    )
    try:
        with ThreadPoolExecutor(2) as pool:
            slow = pool.submit(
                httpx.post,
                server.url + "/v1/completions",
                json={"model": MODEL, "prompt": "x", "structured_outputs": {"regex": "stuck+"}},
                timeout=60,
            )
            plain = _post(server, "/v1/completions", {"prompt": "Name: ", "max_tokens": 4})
            r = slow.result()
    finally:
        release.set()
    assert plain["choices"][0]["finish_reason"] == "length"
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "structured_outputs.regex" and "exceeded" in err["message"]
