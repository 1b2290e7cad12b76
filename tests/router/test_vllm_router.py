"""The router in front of vLLM without a vLLM: an adapter's block keys; which generations resume
token for token, the completions request that goes on with them, and its events as the client's
original stream (tests/vllm/ runs the real thing)."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvmesh.common.block_keys import block_keys
from kvmesh.common.lora import adapter_identity, vllm_adapter_identity
from kvmesh.router import vllm_resume
from kvmesh.router.client_stream import ClientStream
from kvmesh.router.prompt_tokens import PromptTokens


def test_a_request_naming_an_adapter_has_the_adapters_keys_in_front_of_vllm():
    class Ids:
        def encode(self, text):
            return list(range(len(text)))

    req = {"model": "sql", "prompt": "x" * 40}
    vllm = PromptTokens(Ids(), "base", 4, engine="vllm")
    ours = PromptTokens(Ids(), "base", 4)
    ids = list(range(40))
    assert vllm.tokens_and_keys("/v1/completions", req, False, False)[1] == block_keys(
        ids, vllm_adapter_identity("sql"), 4
    )
    # a kvmesh engine's adapter: its name and the digest of its files
    identity = ours.identity(req, "0123456789abcdef")
    assert identity == adapter_identity("base", "sql", "0123456789abcdef")
    assert ours.tokens_and_keys("/v1/completions", req, False, False, identity)[1] == block_keys(
        ids, identity, 4
    )
    same = {**req, "model": "base"}
    for tokens in (vllm, ours):
        assert tokens.adapter(same) is None and tokens.adapter(req) == "sql"
        assert tokens.tokens_and_keys("/v1/completions", same, False, False)[1] == block_keys(
            ids, "base", 4
        )


@pytest.mark.parametrize(
    "req, why",
    [
        ({"temperature": 0}, None),
        ({"top_k": 1, "temperature": 0.7}, None),
        ({}, "sampled"),
        ({"temperature": 0.8, "seed": 3}, "sampled"),
        ({"temperature": 0, "stop": ["\n"]}, "`stop`"),
        ({"temperature": 0, "response_format": {"type": "json_object"}}, "`response_format`"),
        ({"temperature": 0, "tools": [{"type": "function"}]}, "`tools`"),
        ({"temperature": 0, "frequency_penalty": 0.5}, "`frequency_penalty`"),
        ({"temperature": 0, "frequency_penalty": 0}, None),
    ],
)
def test_only_what_vllm_would_generate_identically_resumes(req, why):
    got = vllm_resume.inexact(req, 1)
    assert got == why if why is None else why in got


def test_several_choices_do_not_resume():
    assert vllm_resume.inexact({"temperature": 0}, 2) == "several choices"


def test_the_continuation_prompts_with_the_ids_and_keeps_the_budget():
    req = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0,
        "max_completion_tokens": 10,
        "min_tokens": 5,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        "seed": 1,
    }
    body = json.loads(vllm_resume.continuation_body(req, True, [1, 2, 3], [7, 8]))
    assert body == {
        "model": "m",
        "prompt": [1, 2, 3, 7, 8],
        "stream": True,
        "return_token_ids": True,
        "temperature": 0,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 8,
        "min_tokens": 3,
    }


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_a_chat_stream_goes_on_with_completions_events_as_chat_chunks():
    sent = []

    async def send(msg):
        sent.append(msg)

    async def run():
        stream = ClientStream(send, want_ids=False, chat=True)
        head = {"id": "chatcmpl-1", "created": 5, "model": "m", "object": "chat.completion.chunk"}
        await stream.feed(
            _sse(
                {
                    **head,
                    "prompt_token_ids": [1, 2, 3],
                    "choices": [{"index": 0, "delta": {"role": "assistant"}}],
                }
            )
            + _sse(
                {**head, "choices": [{"index": 0, "delta": {"content": "Hel"}, "token_ids": [7]}]}
            )
        )
        assert stream.prompt_ids == {0: [1, 2, 3]} and stream.output_ids == [7]
        stream.resuming(restart=False, since=0.0, completions=True)
        cont = {"id": "cmpl-9", "created": 9, "model": "m", "object": "text_completion"}
        await stream.feed(
            _sse(
                {
                    **cont,
                    "choices": [
                        {
                            "index": 0,
                            "text": "lo",
                            "token_ids": [8],
                            "prompt_token_ids": [1, 2, 3, 7],
                            "finish_reason": "length",
                        }
                    ],
                }
            )
            + _sse(
                {
                    **cont,
                    "choices": [],
                    "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
                }
            )
        )
        return stream

    stream = asyncio.run(run())
    events = [
        json.loads(line[6:])
        for msg in sent
        for line in msg["body"].decode().split("\n\n")
        if line.startswith("data: {")
    ]
    last, usage = events[-2], events[-1]
    assert last["object"] == "chat.completion.chunk" and last["id"] == "chatcmpl-1"
    assert last["created"] == 5 and "prompt_token_ids" not in last["choices"][0]
    assert last["choices"][0]["delta"] == {"content": "lo"} and "text" not in last["choices"][0]
    assert "token_ids" not in last["choices"][0]  # the client did not ask for the ids
    assert stream.output_ids == [7, 8] and stream.finish_reasons == {0: "length"}
    assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
