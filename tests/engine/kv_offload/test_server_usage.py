"""A server with a host tier: usage splits the cached tokens by tier (chat and completions,
streamed and not), and /metrics carries the tiers' costs, blocks and hit tokens."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from kvmesh.common.kv_tiers import COST_METRIC, USAGE_BY_MEDIUM
from kvmesh.engine.config import ModelConfig
from tests.engine.conftest import random_prompts
from tests.engine.server.conftest import ThreadServer


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    per_block = ModelConfig.from_dir(tiny_llama_dir).kv_bytes_per_block(16, torch.float32)
    srv = ThreadServer(
        [
            "--model",
            tiny_llama_dir,
            "--served-model-name",
            "tiny",
            "--dtype",
            "float32",
            "--num-kv-blocks",
            "16",
            "--kv-offloading-size",
            str(64 * per_block / 2**30),
        ]
    ).start()
    yield srv
    srv.stop()


def complete(srv, prompt, stream=False, **kw):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, **kw}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        return last_usage(httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60))
    return httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).json()["usage"]


def last_usage(resp) -> dict:
    usage = None
    for line in resp.text.splitlines():
        if line.startswith("data: {"):
            usage = json.loads(line[6:]).get("usage") or usage
    return usage


def by_medium(usage) -> dict:
    return usage["prompt_tokens_details"][USAGE_BY_MEDIUM]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completions_usage_splits_cached_tokens_by_tier(server, stream):
    prefix = random_prompts(1, 64, 64, seed=21 + stream)[0]
    complete(server, prefix + [5, 6])
    for filler in random_prompts(3, 100, 110, seed=31 + stream):
        complete(server, filler)  # more than the KV cache: the prefix goes to the host tier
    usage = complete(server, prefix + [7, 8], stream=stream)
    split = by_medium(usage)
    assert set(split) == {"GPU", "CPU", "SHARED"}
    assert split["CPU"] > 0
    assert sum(split.values()) == usage["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_usage_has_the_split_too(server, stream):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "a KV cache bigger than one pod " * 8}],
        "max_tokens": 4,
        "temperature": 0,
    }
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    for _ in range(2):
        resp = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    usage = last_usage(resp) if stream else resp.json()["usage"]
    split = by_medium(usage)
    assert sum(split.values()) == usage["prompt_tokens_details"]["cached_tokens"] > 0


def test_metrics_carry_the_tiers(server):
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for sample in (
        f'{COST_METRIC}{{model_name="tiny",source="prefill"}}',
        f'{COST_METRIC}{{model_name="tiny",source="CPU"}}',
        f'{COST_METRIC}{{model_name="tiny",source="SHARED"}}',
        'kvmesh:kv_tier_blocks{medium="CPU",model_name="tiny"}',
        'kvmesh:kv_tier_hit_tokens_total{medium="CPU",model_name="tiny"}',
    ):
        assert sample in text, sample
