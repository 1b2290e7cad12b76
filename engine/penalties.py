"""Per-request logit adjustments before sampling: penalties and logit bias, as vLLM applies them.

* repetition_penalty (CTRL, as in transformers): a token seen in the prompt or the
  output has its logit divided by the penalty when positive, multiplied when negative;
* frequency_penalty (OpenAI): subtracted once per occurrence in the output;
* presence_penalty (OpenAI): subtracted once from every token the output holds;
* logit_bias (OpenAI): a per-token value added to the logit, last.

Only the rows that ask for a penalty are touched: their token counts are built with
one scatter over the batch's padded token ids, so the cost stays out of other rows.
"""

from __future__ import annotations

import torch

from kvmesh.engine.request import Request


def to_device(values: list, dtype: torch.dtype, device) -> torch.Tensor:
    """A host list on the device without waiting for the device's queued work: through pinned
    memory and an asynchronous copy on CUDA (a pageable copy would synchronise the stream)."""
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def _padded(rows: list[list[int]], pad: int, device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    out = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    if torch.device(device).type == "cuda":
        return out.pin_memory().to(device, non_blocking=True)
    return out


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Penalised logits (a new tensor when any row has a penalty, else ``logits`` itself)."""
    rows = [i for i, r in enumerate(requests) if r.sampling_params.adjusts_logits]
    if not rows:
        return logits
    vocab, dev = logits.shape[-1], logits.device
    params = [requests[i].sampling_params for i in rows]
    # Token ids past the vocabulary (the model's padded rows) land in the spare column `vocab`.
    outputs = _padded([requests[i].output_token_ids for i in rows], vocab, dev).clamp(max=vocab)
    counts = torch.zeros(len(rows), vocab + 1, device=dev)
    counts.scatter_add_(1, outputs, torch.ones_like(outputs, dtype=counts.dtype))
    counts = counts[:, :vocab]

    sub = logits[rows].float()
    if any(p.repetition_penalty != 1.0 for p in params):
        rep = to_device([p.repetition_penalty for p in params], torch.float32, dev)[:, None]
        prompts = _padded([requests[i].prompt_token_ids for i in rows], vocab, dev).clamp(max=vocab)
        seen = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=dev)
        seen.scatter_(1, prompts, True)
        seen = seen[:, :vocab] | (counts > 0)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = to_device([p.frequency_penalty for p in params], torch.float32, dev)[:, None]
    pres = to_device([p.presence_penalty for p in params], torch.float32, dev)[:, None]
    sub = sub - freq * counts - pres * (counts > 0)
    biased = [
        (j, tid, bias) for j, p in enumerate(params) for tid, bias in (p.logit_bias or {}).items()
    ]
    if biased:
        at_row, at_tok, bias = zip(*biased)
        sub[list(at_row), list(at_tok)] += to_device(list(bias), sub.dtype, dev)

    out = logits.clone()
    out[rows] = sub.to(logits.dtype)
    return out
