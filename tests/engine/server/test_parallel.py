"""32+ parallel streams through the server produce exactly the offline engine's greedy outputs."""

from __future__ import annotations

import asyncio

import openai
import pytest

from kvmesh.engine import LLM, SamplingParams
from tests.engine.server.conftest import ThreadServer

pytestmark = pytest.mark.slow

ENGINE_ARGS = {"num_kv_blocks": 512, "max_num_seqs": 64, "dtype": "float32"}
N_STREAMS = 32
MAX_TOKENS = 16


def _prompts() -> list[str]:
    topics = ["the sea", "a robot", "bread", "winter", "a library", "jazz", "mountains", "a cat"]
    return [
        f"Write one sentence about {topics[i % len(topics)]} (variant {i})."
        for i in range(N_STREAMS)
    ]


@pytest.fixture(scope="module")
def offline() -> list[list[int]]:
    llm = LLM("smollm2-135m-instruct", **ENGINE_ARGS)
    outs = llm.generate(_prompts(), SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    result = [o.token_ids for o in outs]
    del llm
    return result


@pytest.fixture(scope="module")
def server(offline):
    srv = ThreadServer(
        [
            "--model",
            "smollm2-135m-instruct",
            "--num-kv-blocks",
            "512",
            "--max-num-seqs",
            "64",
            "--dtype",
            "float32",
        ]
    ).start()
    yield srv
    srv.stop()


def test_parallel_streams_match_offline_greedy(server, offline):
    tokenizer = server.state.engine.tokenizer

    async def one(client, prompt):
        stream = await client.completions.create(
            model="smollm2-135m-instruct",
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            logprobs=0,
            stream_options={"include_usage": True},
        )
        text, tokens, usage, finish = "", [], None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                tokens += chunk.choices[0].logprobs.tokens if chunk.choices[0].logprobs else []
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage
        return text, tokens, usage, finish

    async def main():
        client = openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300
        )
        try:
            return await asyncio.gather(*(one(client, p) for p in _prompts()))
        finally:
            await client.close()

    results = asyncio.run(main())
    assert len(results) == N_STREAMS
    for (text, tokens, usage, finish), ids in zip(results, offline):
        assert usage.completion_tokens == len(ids)
        assert tokens == [
            tokenizer.decode([t], skip_special_tokens=False) for t in ids
        ]  # token for token
        assert text == tokenizer.decode(ids), (text, tokenizer.decode(ids))
        assert finish in ("length", "stop")
