"""The client's side of a resumable stream, without engines: which events go out as they came,
which are rewritten (token ids taken out, a continuation's id and created), which are held back
(the engine's own failure), and the body the router sends upstream."""

from __future__ import annotations

import asyncio
import json
import time

from kvmesh.common.json_body import load_json
from kvmesh.router import resume
from kvmesh.router.call import Call
from kvmesh.router.client_stream import ABORTED, ENGINE_ERROR, ClientStream


def ev(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def chunk(text: str, ids: list[int] | None, cid="cmpl-1", created=100, finish=None, **extra) -> dict:
    choice = {"index": 0, "text": text, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    return {"id": cid, "object": "text_completion", "created": created, "model": "m", "choices": [choice], **extra}


def run(stream: ClientStream, *pieces: bytes) -> list:
    return [asyncio.run(stream.feed(p)) for p in pieces]


def client_stream(want_ids=False, chat=False):
    sent = []

    async def send(msg):
        sent.append(msg)

    return ClientStream(send, want_ids, chat), sent


def events(sent) -> list:
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return [e[6:].decode() if e.startswith(b"data: [DONE]") else json.loads(e[6:])
            for e in body.split(b"\n\n") if e.startswith(b"data: ")]


def test_ids_are_collected_and_taken_out_even_when_an_event_is_split_across_reads():
    stream, sent = client_stream()
    whole = ev(chunk(" a", [5], prompt_token_ids=[1, 2])) + ev(chunk(" b", [6, 7]))
    assert run(stream, whole[:10], whole[10:40], whole[40:]) == [None, None, None]
    assert stream.output_ids == [5, 6, 7] and stream.engine_sends_ids
    out = events(sent)
    assert [e["choices"][0]["text"] for e in out] == [" a", " b"]
    assert all("token_ids" not in e["choices"][0] and "prompt_token_ids" not in e for e in out)


def test_events_without_ids_go_out_byte_for_byte():
    stream, sent = client_stream()
    raw = b'data: {"id":"x","created":1,"choices":[{"index":0,"text":" a","finish_reason":null}]}\n\n'
    run(stream, raw + b"data: [DONE]\n\n")
    assert b"".join(m["body"] for m in sent) == raw + b"data: [DONE]\n\n"
    assert stream.done and not stream.engine_sends_ids


def test_the_client_that_asked_for_ids_gets_them():
    stream, sent = client_stream(want_ids=True)
    run(stream, ev(chunk(" a", [5], prompt_token_ids=[1, 2])))
    assert events(sent)[0]["choices"][0]["token_ids"] == [5] and events(sent)[0]["prompt_token_ids"] == [1, 2]


def test_a_continuation_keeps_the_original_id_and_created():
    stream, sent = client_stream()
    run(stream, ev(chunk(" a", [5])))
    stream.resuming(restart=False, since=time.perf_counter())
    run(stream, ev(chunk(" b", [6], cid="cmpl-other", created=200)))
    assert [(e["id"], e["created"]) for e in events(sent)] == [("cmpl-1", 100), ("cmpl-1", 100)]


def test_the_engines_own_failures_are_held_back():
    stream, sent = client_stream()
    assert run(stream, ev(chunk(" a", [5])) + ev({"error": {"message": "boom", "code": "x"}}) + ev(chunk(" z", [9]))) \
        == [ENGINE_ERROR]
    assert [e["choices"][0]["text"] for e in events(sent)] == [" a"] and stream.output_ids == [5]
    stream, sent = client_stream()
    assert run(stream, ev(chunk(" a", [5], finish="abort"))) == [ABORTED]
    out = events(sent)  # the text it carried goes out, its "abort" does not: the generation goes on
    assert [e["choices"][0]["text"] for e in out] == [" a"] and out[0]["choices"][0]["finish_reason"] is None
    assert stream.output_ids == [5] and not stream.finished


def test_a_restart_drops_the_chat_role_chunk_the_client_already_had():
    stream, sent = client_stream(chat=True)
    role = {"id": "c", "created": 1, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                  "token_ids": [], "finish_reason": None}], "prompt_token_ids": [1]}
    run(stream, ev(role))
    stream.resuming(restart=True, since=time.perf_counter())
    first = {"id": "c", "created": 1, "choices": [{"index": 0, "delta": {"content": "Hi"}, "token_ids": [8],
                                                   "finish_reason": None}]}
    run(stream, ev({**role, "id": "d"}) + ev(first))
    out = events(sent)
    assert [e["choices"][0]["delta"] for e in out] == [{"role": "assistant", "content": ""}, {"content": "Hi"}]


def test_a_stream_ended_by_the_router_has_its_finish_usage_and_done():
    stream, sent = client_stream()
    run(stream, ev(chunk(" a", [5])))
    asyncio.run(stream.finish("length", {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}))
    out = events(sent)
    assert out[1]["choices"][0]["finish_reason"] == "length" and out[1]["id"] == "cmpl-1"
    assert out[2]["usage"]["total_tokens"] == 4 and out[2]["choices"] == [] and out[3] == "[DONE]"


def test_the_upstream_body_asks_for_ids_without_re_encoding_the_prompt():
    body = b'  {"prompt": "x", "stream": true}'
    out = resume.stream_body(body, load_json(body))
    assert out.endswith(b'"prompt": "x", "stream": true}')  # the client's bytes, after the one key
    assert load_json(out) == {"return_token_ids": True, "prompt": "x", "stream": True}
    assert load_json(resume.stream_body(b"{}", {})) == {"return_token_ids": True}
    asked_not = b'{"prompt": "x", "return_token_ids": false}'
    assert load_json(resume.stream_body(asked_not, load_json(asked_not)))["return_token_ids"] is True
    asked = b'{"prompt": "x", "return_token_ids": true}'
    assert resume.stream_body(asked, load_json(asked)) == asked
    cont = load_json(resume.continuation_body({"prompt": "x", "max_tokens": 9}, [4, 5]))
    assert cont == {"prompt": "x", "max_tokens": 9, "return_token_ids": True, "resume": {"output_token_ids": [4, 5]}}


def test_which_requests_may_be_resumed():
    def call(path, req):
        c = Call(t0=0, path=path, route=path, headers={}, rid="r", extra=[], client_id="c")
        c.req, c.generate = req, True
        return c
    assert resume.resumable(call("/v1/completions", {"prompt": "x"}), 2)
    assert resume.resumable(call("/v1/completions", {"prompt": [1, 2, 3]}), 2)
    assert not resume.resumable(call("/v1/completions", {"prompt": ["x", "y"]}), 2)  # a batch
    assert not resume.resumable(call("/v1/chat/completions", {"messages": [], "n": 2}), 2)
    assert not resume.resumable(call("/v1/chat/completions", {"messages": []}), 0)  # --max-resumes 0
    assert resume.max_tokens({"max_tokens": 5, "max_completion_tokens": 7}, chat=True) == 7
    assert resume.max_tokens({"max_tokens": 5}, chat=False) == 5
