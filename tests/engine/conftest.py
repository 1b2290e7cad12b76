from __future__ import annotations

import functools
import random

import pytest

from kvmesh.engine.builtin import resolve_model_dir
from tests.tiny_models import build_tiny_model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "tiny-qwen2"))


@pytest.fixture(scope="session")
def smollm2_dir():
    return str(resolve_model_dir("smollm2-135m-instruct"))


@functools.lru_cache(maxsize=4)
def _hf_model(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=256)
def _hf_greedy_cached(
    model_dir: str,
    prompt: tuple[int, ...],
    max_new_tokens: int,
    ignore_eos: bool,
    repetition_penalty: float = 1.0,
):
    import torch
    from transformers import GenerationConfig

    model = _hf_model(model_dir)
    eos = None if ignore_eos else model.generation_config.eos_token_id
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        repetition_penalty=repetition_penalty,
        pad_token_id=model.config.pad_token_id or 0,
    )
    saved = model.generation_config.eos_token_id
    if ignore_eos:  # unset values are filled from the model's own generation config
        model.generation_config.eos_token_id = None
    try:
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), generation_config=config)
    finally:
        model.generation_config.eos_token_id = saved
    return tuple(out[0, len(prompt) :].tolist())


def hf_greedy(
    model_dir: str,
    prompt: list[int],
    max_new_tokens: int,
    ignore_eos: bool,
    repetition_penalty: float = 1.0,
) -> list[int]:
    """Transformers' greedy fp32 continuation of one prompt (cached across tests)."""
    return list(
        _hf_greedy_cached(model_dir, tuple(prompt), max_new_tokens, ignore_eos, repetition_penalty)
    )


def random_prompts(
    n: int, min_len: int, max_len: int, seed: int = 0, vocab: int = 49152
) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(3, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)
    ]
