"""The client's side of a resumable stream, without engines: which events go out as they came,
which are rewritten (token ids taken out, a continuation's id and created), which are held back
(the engine's own failure), and the body the router sends upstream."""

from __future__ import annotations

import asyncio
import json
import time

from kvmesh.common.json_body import load_json
from kvmesh.router import resume
from kvmesh.router.client_stream import ABORTED, ENGINE_ERROR, ClientStream
from kvmesh.router.request_state import Call


def ev(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def chunk(
    text: str, ids: list[int] | None, cid="cmpl-1", created=100, finish=None, **extra
) -> dict:
    choice = {"index": 0, "text": text, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    return {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": "m",
        "choices": [choice],
        **extra,
    }


def run(stream: ClientStream, *pieces: bytes) -> list:
    return [asyncio.run(stream.feed(p)) for p in pieces]


def client_stream(want_ids=False, chat=False, num_choices=1, n=1):
    sent = []

    async def send(msg):
        sent.append(msg)

    return ClientStream(send, want_ids, chat, num_choices, n), sent


def events(sent) -> list:
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return [
        e[6:].decode() if e.startswith(b"data: [DONE]") else json.loads(e[6:])
        for e in body.split(b"\n\n")
        if e.startswith(b"data: ")
    ]


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
    raw = (
        b'data: {"id":"x","created":1,"choices":[{"index":0,"text":" a","finish_reason":null}]}\n\n'
    )
    run(stream, raw + b"data: [DONE]\n\n")
    assert b"".join(m["body"] for m in sent) == raw + b"data: [DONE]\n\n"
    assert stream.done and not stream.engine_sends_ids


def test_the_client_that_asked_for_ids_gets_them():
    stream, sent = client_stream(want_ids=True)
    run(stream, ev(chunk(" a", [5], prompt_token_ids=[1, 2])))
    assert events(sent)[0]["choices"][0]["token_ids"] == [5] and events(sent)[0][
        "prompt_token_ids"
    ] == [1, 2]


def test_a_continuation_keeps_the_original_id_and_created():
    stream, sent = client_stream()
    run(stream, ev(chunk(" a", [5])))
    stream.resuming(restart=False, since=time.perf_counter())
    run(stream, ev(chunk(" b", [6], cid="cmpl-other", created=200)))
    assert [(e["id"], e["created"]) for e in events(sent)] == [("cmpl-1", 100), ("cmpl-1", 100)]


def test_the_engines_own_failures_are_held_back():
    stream, sent = client_stream()
    assert run(
        stream,
        ev(chunk(" a", [5]))
        + ev({"error": {"message": "boom", "code": "x"}})
        + ev(chunk(" z", [9])),
    ) == [ENGINE_ERROR]
    assert [e["choices"][0]["text"] for e in events(sent)] == [" a"] and stream.output_ids == [5]
    stream, sent = client_stream()
    assert run(stream, ev(chunk(" a", [5], finish="abort"))) == [ABORTED]
    out = events(sent)  # the text it carried goes out, its "abort" does not: the generation goes on
    assert [e["choices"][0]["text"] for e in out] == [" a"] and out[0]["choices"][0][
        "finish_reason"
    ] is None
    assert stream.output_ids == [5] and not stream.finished


def test_a_restart_drops_the_chat_role_chunk_the_client_already_had():
    stream, sent = client_stream(chat=True)
    role = {
        "id": "c",
        "created": 1,
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "token_ids": [],
                "finish_reason": None,
            }
        ],
        "prompt_token_ids": [1],
    }
    run(stream, ev(role))
    stream.resuming(restart=True, since=time.perf_counter())
    first = {
        "id": "c",
        "created": 1,
        "choices": [
            {"index": 0, "delta": {"content": "Hi"}, "token_ids": [8], "finish_reason": None}
        ],
    }
    run(stream, ev({**role, "id": "d"}) + ev(first))
    out = events(sent)
    assert [e["choices"][0]["delta"] for e in out] == [
        {"role": "assistant", "content": ""},
        {"content": "Hi"},
    ]


def test_a_stream_ended_by_the_router_has_its_finish_usage_and_done():
    stream, sent = client_stream()
    run(stream, ev(chunk(" a", [5])))
    asyncio.run(
        stream.finish(
            {0: "length"}, {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        )
    )
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
    assert (
        load_json(resume.stream_body(asked_not, load_json(asked_not)))["return_token_ids"] is True
    )
    asked = b'{"prompt": "x", "return_token_ids": true}'
    assert resume.stream_body(asked, load_json(asked)) == asked
    cont = load_json(
        resume.continuation_body({"prompt": "x", "max_tokens": 9}, {"output_token_ids": [4, 5]})
    )
    assert cont == {
        "prompt": "x",
        "max_tokens": 9,
        "return_token_ids": True,
        "resume": {"output_token_ids": [4, 5]},
    }


def test_which_requests_may_be_resumed():
    def call(path, req):
        c = Call(t0=0, path=path, route=path, headers={}, rid="r", extra=[], client_id="c")
        c.req, c.generate = req, True
        return c

    assert resume.resumable(call("/v1/completions", {"prompt": "x"}), 2)
    assert resume.resumable(call("/v1/completions", {"prompt": [1, 2, 3]}), 2)
    assert resume.resumable(
        call("/v1/completions", {"prompt": ["x", "y"], "n": 3}), 2
    )  # a batch, n > 1
    assert resume.choices(call("/v1/completions", {"prompt": ["x", "y"], "n": 3})) == (6, 3)
    assert resume.choices(call("/v1/completions", {"prompt": [[1], [2], [3]]})) == (3, 1)
    assert resume.resumable(call("/v1/chat/completions", {"messages": [], "n": 2}), 2)
    assert resume.choices(call("/v1/chat/completions", {"messages": [], "n": 2})) == (2, 2)
    assert not resume.resumable(call("/v1/completions", {"prompt": "x", "n": 2, "best_of": 3}), 2)
    assert not resume.resumable(call("/v1/completions", {"prompt": "x", "n": "2"}), 2)  # malformed
    assert not resume.resumable(
        call("/v1/chat/completions", {"messages": []}), 0
    )  # --max-resumes 0
    assert resume.max_tokens({"max_tokens": 5, "max_completion_tokens": 7}, chat=True) == 7
    assert resume.max_tokens({"max_tokens": 5}, chat=False) == 5


def multi(index: int, text: str, ids: list[int], finish=None, **extra) -> bytes:
    obj = chunk(text, ids, finish=finish)
    obj["choices"][0]["index"] = index
    obj["choices"][0].update(extra)
    return ev(obj)


def test_several_choices_are_tracked_each_and_a_continuation_lists_the_running_ones():
    """A batch of 2 prompts x n = 2: choice 1 finishes before the break; choice 3 has no output yet."""
    stream, sent = client_stream(num_choices=4, n=2)
    run(
        stream,
        multi(0, " a", [5], prompt_token_ids=[1, 2, 3]),
        multi(1, " b", [6], prompt_token_ids=[1, 2, 3]),
        multi(2, " c", [7], prompt_token_ids=[9, 9]),
        multi(1, "", [8], finish="stop"),
        multi(0, " d", [10]),
    )
    assert stream.ids == {0: [5, 10], 1: [6, 8], 2: [7]} and stream.finish_reasons == {1: "stop"}
    assert (
        stream.prompt_tokens == {0: 3, 1: 2}
        and not stream.finished
        and stream.running() == [0, 2, 3]
    )
    assert stream.continuation() == {
        "choices": [
            {"index": 0, "output_token_ids": [5, 10]},
            {"index": 2, "output_token_ids": [7]},
            {"index": 3, "output_token_ids": []},
        ]
    }
    assert stream.spent(2) == [0] and stream.spent(None) == []
    # re-prefilled: the running choices 0, 2 and 3, each its prompt and its ids (the fallback unused)
    assert stream.resume_tokens(4) == (3 + 2) + (2 + 1) + (2 + 0)
    assert all(
        "token_ids" not in c and "prompt_token_ids" not in c
        for e in events(sent)
        for c in e["choices"]
    )
    # the continuation counts its choices' prompts and outputs; choice 1's output is added back
    stream.resuming(restart=False, since=time.perf_counter())
    cont_usage = {
        "prompt_tokens": 5,
        "completion_tokens": 30,
        "total_tokens": 35,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    run(
        stream,
        multi(3, " e", [11], finish="length"),
        ev({**chunk("", None, cid="cmpl-2", created=200), "choices": [], "usage": cont_usage}),
    )
    usage = events(sent)[-1]["usage"]
    assert usage == {
        "prompt_tokens": 5,
        "completion_tokens": 32,
        "total_tokens": 37,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    assert events(sent)[-1]["id"] == "cmpl-1" and events(sent)[-1]["created"] == 100


def test_a_prompt_whose_every_choice_finished_is_added_back_to_the_usage():
    stream, sent = client_stream(num_choices=4, n=2)
    run(
        stream,
        multi(0, " a", [5], prompt_token_ids=[1, 2, 3], finish="stop"),
        multi(1, " b", [6, 7], prompt_token_ids=[1, 2, 3], finish="length"),
        multi(2, " c", [8], prompt_token_ids=[9, 9]),
    )
    stream.resuming(restart=False, since=time.perf_counter())
    assert stream.usage_offset == (3, 3)  # prompt 0's tokens, choices 0 and 1's outputs


def test_a_stream_of_several_choices_ended_by_the_router_closes_each():
    stream, sent = client_stream(chat=True, num_choices=2, n=2)
    run(
        stream,
        ev(
            {
                "id": "c",
                "created": 1,
                "model": "m",
                "object": "chat.completion.chunk",
                "prompt_token_ids": [1, 2],
                "choices": [
                    {
                        "index": 0,
                        "delta": {"content": "x"},
                        "token_ids": [3],
                        "finish_reason": "stop",
                    }
                ],
            }
        ),
        ev(
            {
                "id": "c",
                "created": 1,
                "model": "m",
                "object": "chat.completion.chunk",
                "choices": [
                    {
                        "index": 1,
                        "delta": {"content": "y"},
                        "token_ids": [4, 5],
                        "finish_reason": None,
                    }
                ],
            }
        ),
    )
    assert stream.spent(2) == [1]
    asyncio.run(stream.finish({1: "length"}, stream.whole_usage(0)))
    out = events(sent)
    assert out[2]["choices"] == [
        {"index": 1, "delta": {}, "logprobs": None, "finish_reason": "length"}
    ]
    assert (
        out[3]["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
        and out[4] == "[DONE]"
    )
    assert stream.finished


def test_a_finish_under_an_index_the_request_does_not_have_ends_nothing():
    """Two choices: a finish reported for index 5 (an engine's mistake) does not end the stream."""
    stream, _ = client_stream(num_choices=2, n=2)
    run(stream, multi(0, " a", [5], finish="stop"), multi(5, "", [6], finish="stop"))
    assert not stream.finished and stream.running() == [1]
    run(stream, multi(1, " b", [7], finish="length"))
    assert stream.finished


def test_a_restart_passes_on_the_role_chunks_the_client_has_not_had():
    """n = 2: the engine failed after choice 0's role chunk; the restart's role chunk of choice 0
    is dropped, choice 1's goes out (once)."""
    stream, sent = client_stream(chat=True, num_choices=2, n=2)

    def role(i):
        return ev(
            {
                "id": "c",
                "created": 1,
                "choices": [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "token_ids": [],
                        "finish_reason": None,
                    }
                ],
            }
        )

    run(stream, role(0))
    stream.resuming(restart=True, since=time.perf_counter())
    run(stream, role(0) + role(1))
    assert [c["index"] for e in events(sent) for c in e["choices"]] == [0, 1]
