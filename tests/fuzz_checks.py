"""Schemathesis settings and extra checks shared by the engine's and the router's API fuzz tests.

The built-in checks run: no 5xx (``not_a_server_error``), every status documented, the body's
media type documented, the body valid against its schema (SSE events one by one, through
``contentSchema``), documented headers (``Retry-After``) well formed, and no 2xx without the
API key (``ignored_auth``). Not run: ``positive_data_acceptance`` (a body the schema allows may
still be refused: its prompt may not fit the context, the server may be full) and
``negative_data_rejection`` (the engine, like OpenAI's, reads ``"5"`` as 5 and ignores unknown
fields). Ours: strict JSON (no NaN or Infinity, which Python writes and JSON has not) and a
well-formed stream (its last event is ``[DONE]``; an error event only just before it).
"""

from __future__ import annotations

import json
import os
from typing import Any

import schemathesis
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

# Small and fixed: `make test` runs this on a busy 2-core machine, so a few dozen cases per
# operation; derandomized so a failure reproduces (its exact input becomes a regression test).
# KVMESH_FUZZ_EXAMPLES=500 KVMESH_FUZZ_SEED=7 explores further (random, off `make test`).
MAX_EXAMPLES = int(os.environ.get("KVMESH_FUZZ_EXAMPLES", "12"))
SEED = os.environ.get("KVMESH_FUZZ_SEED")
FUZZ_SETTINGS = settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=SEED is None,
    database=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)
REQUEST_TIMEOUT = 30.0  # a hang fails the case instead of the whole run


def config() -> schemathesis.Config:
    """Fuzzing only (no coverage phase: its boundary sweep of ~30 body fields is hundreds of
    requests per operation); the same cases on every run."""
    return schemathesis.Config.from_dict(
        {
            "seed": 20240601,
            "phases": {
                "coverage": {"enabled": False},
                "examples": {"enabled": False},
                "stateful": {"enabled": False},
            },
            "generation": {"max-examples": MAX_EXAMPLES},
            "max-stream-events": 100000,  # read every stream to its end (the default stops at 20 events)
        }
    )


def _strict_loads(text: str | bytes) -> Any:
    def refuse(name: str):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def strict_json(ctx, response, case) -> bool | None:
    """JSON bodies and SSE events parse as RFC 8259 JSON, and a stream ends well."""
    ctype = response.headers.get("content-type", [""])
    ctype = (ctype[0] if isinstance(ctype, list) else ctype) or ""
    if "application/json" in ctype:
        try:
            _strict_loads(response.content)
        except ValueError as exc:
            raise AssertionError(
                f"the body is not strict JSON: {exc}: {response.content[:300]!r}"
            ) from None
    elif "text/event-stream" in ctype:
        assert not response.stream_cut_short, "the stream was cut short (raise max-stream-events)"
        events = [
            line[len("data: ") :]
            for line in response.content.decode().split("\n\n")
            if line.strip()
        ]
        assert events, "an empty event stream"
        assert all(isinstance(e, str) for e in events)
        assert events[-1] == "[DONE]", f"the stream does not end with [DONE]: {events[-1][:300]!r}"
        for i, event in enumerate(events[:-1]):
            assert event != "[DONE]", "[DONE] before the end of the stream"
            try:
                obj = _strict_loads(event)
            except ValueError as exc:
                raise AssertionError(
                    f"event {i} is not strict JSON: {exc}: {event[:300]!r}"
                ) from None
            if "error" in obj:
                assert i == len(events) - 2, "an error event that is not the last before [DONE]"
    return None


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
    ignored_auth,
    strict_json,
]


def call_and_check(case, headers: dict[str, str] | None = None):
    """Send one case over real HTTP and run the checks; returns the response."""
    response = case.call(headers=headers, timeout=REQUEST_TIMEOUT)
    case.validate_response(response, checks=CHECKS, headers=headers)
    return response


GENERATE = ("/v1/completions", "/v1/chat/completions")


def _with_stream(drawn):
    case, stream = drawn
    if stream is not None and isinstance(case.body, dict):
        case.body["stream"] = stream
        if stream and "stream_options" not in case.body:
            case.body["stream_options"] = {"include_usage": True}
    return case


def fuzz(
    schema,
    method: str,
    path: str,
    headers: dict[str, str] | None = None,
    max_examples: int = MAX_EXAMPLES,
) -> None:
    """Fuzz one operation: bodies valid by its schema and bodies that break it (negative mode:
    wrong types, missing fields, out-of-range values), each sent and checked.

    (Hypothesis' own @given over ``operation.as_strategy``: schemathesis' pytest plugin,
    ``schema.parametrize``, needs pytest internals pytest 9 removed.)"""
    operation = schema[path][method.upper()]
    strategy = st.one_of(
        operation.as_strategy(GenerationMode.POSITIVE),
        operation.as_strategy(GenerationMode.NEGATIVE),
    )
    if path in GENERATE:
        # `stream` is one optional field of ~30, so few generated bodies would stream: half do.
        strategy = st.tuples(strategy, st.sampled_from([None, False, True])).map(_with_stream)

    @settings(FUZZ_SETTINGS, max_examples=max_examples)
    @given(case=strategy)
    def run(case):
        call_and_check(case, headers)

    if SEED is not None:
        run = seed(int(SEED))(run)
    run()


def documented_examples(schema) -> list[tuple[str, str, str, Any]]:
    """(method, path, name, body) of every request example the document gives."""
    out = []
    for path, item in schema.raw_schema["paths"].items():
        for method, op in item.items():
            content = (op.get("requestBody") or {}).get("content", {}).get("application/json", {})
            for name, example in (content.get("examples") or {}).items():
                out.append((method, path, name, example["value"]))
    return out


def send_example(schema, method: str, path: str, body: Any, headers: dict[str, str] | None = None):
    """One documented request, sent and checked like a generated one; returns the response."""
    case = schema[path][method.upper()].Case(body=body, media_type="application/json")
    return call_and_check(case, headers)


def check_unsupported_methods(base_url: str, schema, headers: dict[str, str] | None = None) -> int:
    """Every documented path, asked with a method it does not document: 405, an `Allow` header
    naming the documented ones (RFC 9110), an OpenAI error body. Returns the requests made."""
    import httpx

    sent = 0
    with httpx.Client(base_url=base_url, headers=headers, timeout=REQUEST_TIMEOUT) as client:
        for path, item in schema.raw_schema["paths"].items():
            documented = {m.upper() for m in item}
            for method in ("GET", "POST", "PUT", "DELETE", "PATCH"):
                if method in documented:
                    continue
                r = client.request(method, path)
                sent += 1
                assert r.status_code == 405, (method, path, r.status_code, r.text)
                allow = {m.strip() for m in r.headers.get("allow", "").split(",")}
                assert documented <= allow, (method, path, r.headers.get("allow"))
                assert set(_strict_loads(r.content)["error"]) == {
                    "message",
                    "type",
                    "param",
                    "code",
                }
    return sent
