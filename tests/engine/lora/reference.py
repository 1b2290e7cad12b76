"""transformers + peft fp32 greedy continuations of a base checkpoint and its adapters (cached)."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=2)
def _peft_model(base_dir: str, adapters: tuple[tuple[str, str], ...]):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    (first, path), *rest = adapters
    model = PeftModel.from_pretrained(base, path, adapter_name=first)
    for name, path in rest:
        model.load_adapter(path, adapter_name=name)
    return model.eval()


@functools.lru_cache(maxsize=512)
def _greedy(base_dir, adapters, adapter: str | None, prompt: tuple[int, ...], n: int):
    import contextlib

    import torch

    model = _peft_model(base_dir, adapters)
    if adapter is not None:
        model.set_adapter(adapter)
    ids, lps = list(prompt), []
    with torch.inference_mode():
        with model.disable_adapter() if adapter is None else contextlib.nullcontext():
            for _ in range(n):  # no KV cache: each step recomputes the whole sequence
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
                lps.append(float(torch.log_softmax(logits, -1)[ids[-1]]))
    return tuple(ids[len(prompt) :]), tuple(lps)


def peft_greedy(
    base_dir: str, adapter_dirs: dict[str, str], adapter: str | None, prompt, n: int
) -> list[int]:
    """The greedy fp32 continuation of `prompt` by the base model (adapter None) or an adapter."""
    return list(peft_greedy_logprobs(base_dir, adapter_dirs, adapter, prompt, n)[0])


def peft_greedy_logprobs(base_dir, adapter_dirs, adapter, prompt, n):
    """(greedy tokens, the logprob of each) as ``peft_greedy``."""
    adapters = tuple(sorted(adapter_dirs.items()))
    return _greedy(str(base_dir), adapters, adapter, tuple(prompt), n)
