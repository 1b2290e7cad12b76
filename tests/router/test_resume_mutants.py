"""router/resume.py pinned exactly: which requests may be resumed and their choice count, the
upstream body of a resumable stream byte for byte, a continuation's body, the output budget and
the usage flag, each at its edges (the mutation run's selection, with test_client_stream.py)."""

from __future__ import annotations

import json

import pytest

from kvmesh.router import resume
from kvmesh.router.request_state import Call


def call(path: str, req: dict, generate: bool = True) -> Call:
    c = Call(t0=0, path=path, route=path, headers={}, rid="r", extra=[], client_id="c")
    c.req, c.generate = req, generate
    return c


COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.mark.parametrize(
    "path,req,max_resumes,want",
    [
        (COMPLETIONS, {"prompt": "x"}, 1, True),  # one resume allowed is enough
        (COMPLETIONS, {"prompt": "x"}, 0, False),
        (COMPLETIONS, {"prompt": "x"}, -1, False),
        (COMPLETIONS, {"prompt": "x", "best_of": None}, 2, True),
        (COMPLETIONS, {"prompt": "x", "best_of": 1}, 2, True),
        (COMPLETIONS, {"prompt": "x", "best_of": 2}, 2, False),
        (COMPLETIONS, {"prompt": "x", "n": 0}, 2, False),  # malformed: the engine answers it
        (CHAT, {"messages": [], "n": True}, 2, False),  # a bool is no count
        (CHAT, {"messages": []}, 1, True),
    ],
)
def test_which_requests_may_be_resumed(path, req, max_resumes, want):
    assert resume.resumable(call(path, req), max_resumes) is want


def test_only_generations_are_resumed():
    assert resume.resumable(call("/tokenize", {"prompt": "x"}, generate=False), 2) is False


@pytest.mark.parametrize(
    "path,req,want",
    [
        (CHAT, {"messages": []}, (1, 1)),
        (CHAT, {"messages": [], "n": None}, (1, 1)),  # null: the default
        (CHAT, {"messages": [], "n": 1}, (1, 1)),
        (CHAT, {"messages": [], "n": 3}, (3, 3)),
        (CHAT, {"messages": [], "prompt": ["a", "b"], "n": 2}, (2, 2)),  # chat has no batch
        (CHAT, {"messages": [], "n": 0}, None),
        (CHAT, {"messages": [], "n": -2}, None),
        (CHAT, {"messages": [], "n": 2.0}, None),
        (CHAT, {"messages": [], "n": "2"}, None),
        (COMPLETIONS, {"prompt": "x"}, (1, 1)),
        (COMPLETIONS, {"prompt": "x", "n": 2}, (2, 2)),
        (COMPLETIONS, {"prompt": ["x", "y", "z"]}, (3, 1)),
        (COMPLETIONS, {"prompt": ["x", "y", "z"], "n": 2}, (6, 2)),
        (COMPLETIONS, {"prompt": [[1, 2], [3]], "n": 3}, (6, 3)),
        (COMPLETIONS, {"prompt": [1, 2, 3], "n": 2}, (2, 2)),  # one prompt of token ids
        (COMPLETIONS, {"n": 2}, (2, 2)),  # no prompt: one (the engine refuses it)
    ],
)
def test_the_choices_of_a_request(path, req, want):
    assert resume.choices(call(path, req)) == want


def test_the_client_asked_for_ids_only_with_true():
    assert resume.wants_ids({"return_token_ids": True}) is True
    for value in (False, None, 1, "true"):
        assert resume.wants_ids({"return_token_ids": value}) is False
    assert resume.wants_ids({}) is False


@pytest.mark.parametrize(
    "body,out",
    [
        (b'{"prompt": "x"}', b'{"return_token_ids":true,"prompt": "x"}'),
        (b'  \n{"prompt": "x"}', b'{"return_token_ids":true,"prompt": "x"}'),
        (b"{}", b'{"return_token_ids":true}'),
        (b"{ \n }", b'{"return_token_ids":true \n }'),
        (b'{ "a": 1}', b'{"return_token_ids":true, "a": 1}'),
    ],
)
def test_the_upstream_body_gets_the_field_first_without_re_encoding(body, out):
    assert resume.stream_body(body, json.loads(body)) == out


def test_the_upstream_body_is_re_encoded_when_the_client_sent_another_value():
    body = b'{"prompt": "x", "return_token_ids": false}'
    assert (
        resume.stream_body(body, json.loads(body))
        == json.dumps({"prompt": "x", "return_token_ids": True}).encode()
    )
    asked = b'{"return_token_ids": true, "prompt": "x"}'
    assert resume.stream_body(asked, json.loads(asked)) is asked  # as it came
    # a body that is not an object as it starts (the engine answers it): re-encoded whole
    assert (
        resume.stream_body(b'["x"]', {"prompt": "x"})
        == b'{"prompt": "x", "return_token_ids": true}'
    )


def test_a_continuations_body_byte_for_byte():
    req = {"prompt": "x", "max_tokens": 9, "return_token_ids": False, "seed": 3}
    out = resume.continuation_body(req, {"output_token_ids": [4, 5]})
    assert out == (
        b'{"prompt": "x", "max_tokens": 9, "return_token_ids": true, "seed": 3, '
        b'"resume": {"output_token_ids": [4, 5]}}'
    )
    assert req["return_token_ids"] is False  # the client's request is left as it was


@pytest.mark.parametrize(
    "req,chat,want",
    [
        ({"max_tokens": 5}, False, 5),
        ({"max_tokens": 5}, True, 5),
        ({"max_tokens": 5, "max_completion_tokens": 7}, True, 7),
        ({"max_tokens": 5, "max_completion_tokens": 7}, False, 5),  # completions: not its field
        ({"max_completion_tokens": 7}, False, None),
        ({"max_tokens": 5, "max_completion_tokens": None}, True, 5),
        ({"max_tokens": 5.0}, False, None),
        ({"max_tokens": True}, False, None),
        ({"max_completion_tokens": "7"}, True, None),
        ({}, True, None),
    ],
)
def test_the_output_budget(req, chat, want):
    assert resume.max_tokens(req, chat) == want


@pytest.mark.parametrize(
    "req,want",
    [
        ({}, False),
        ({"stream_options": None}, False),
        ({"stream_options": "include_usage"}, False),
        ({"stream_options": {}}, False),
        ({"stream_options": {"include_usage": False}}, False),
        ({"stream_options": {"include_usage": True}}, True),
        ({"stream_options": {"include_usage": 1}}, True),
    ],
)
def test_the_usage_chunk_is_asked_for(req, want):
    assert resume.include_usage(req) is want
