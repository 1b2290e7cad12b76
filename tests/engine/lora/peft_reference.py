"""Transformers + PEFT greedy fp32 continuations: the reference that adapter outputs must equal."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=8)
def _model(base_dir: str, adapter_dir: str | None):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    return model.eval()


@functools.lru_cache(maxsize=512)
def _greedy(base_dir: str, adapter_dir: str | None, prompt: tuple[int, ...], max_new: int):
    import torch

    model = _model(base_dir, adapter_dir)
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = []
        past = None
        for _ in range(max_new):  # step by step: no generation config (eos, pad) gets in the way
            logits = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = logits.past_key_values
            token = int(logits.logits[0, -1].argmax())
            out.append(token)
            ids = torch.tensor([[token]])
    return tuple(out)


def peft_greedy(
    base_dir: str, adapter_dir: str | None, prompt: list[int], max_new: int
) -> list[int]:
    """The greedy continuation of ``prompt`` by the base model with the adapter (None: none)."""
    return list(_greedy(base_dir, adapter_dir, tuple(prompt), max_new))
