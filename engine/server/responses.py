"""What a generation request answers with: SSE framing, stream chunks, whole responses, usage, token ids
and prompt logprobs."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

from kvmesh.common.kv_tiers import MEDIA, USAGE_BY_MEDIUM
from kvmesh.engine.outputs import RequestOutput
from kvmesh.engine.server.choices import Choice


def usage_field(
    prompt_tokens: int,
    completion_tokens: int,
    cached: int,
    by_medium: dict[str, int] | None = None,
) -> dict[str, Any]:
    """``by_medium``: the cached tokens by tier (an engine with KV tiers); None: left out."""
    details: dict[str, Any] = {"cached_tokens": cached}
    if by_medium is not None:
        details[USAGE_BY_MEDIUM] = by_medium
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": details,
    }


def capped_by_medium(by_medium: dict[str, int], limit: int) -> dict[str, int]:
    """A request's cached tokens by tier, the leading ``limit`` only (the tiers hold a prompt's
    blocks in the order GPU, CPU, SHARED)."""
    out = {}
    for medium in MEDIA:
        n = min(by_medium.get(medium, 0), limit)
        out[medium] = n
        limit -= n
    return out


def sse(obj: Any) -> str:
    """One server-sent event: ``data: <compact JSON>`` and a blank line."""
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class ResponseAssembly:
    """The response JSON of a :class:`~kvmesh.engine.server.serving_base.GenerationHandler` (a base of
    it): reads its request (``state``, ``engine``, ``request_id``, ``created``), its kind's class
    attributes and options (``id_prefix``, ``echo_only``, ``return_token_ids``, ...) and ``full_choice``."""

    def token_text(self, tid: int) -> str:
        return self.engine.tokenizer.decode([tid], skip_special_tokens=False)

    def prompt_logprobs_field(self, out: RequestOutput) -> list[dict[str, Any] | None]:
        """vLLM's prompt_logprobs: per prompt token, {token id: logprob, rank, decoded_token} for the
        token itself and the top N."""
        field_ = []
        for lp in out.prompt_logprobs or []:
            if lp is None:
                field_.append(None)
                continue
            entry = {
                str(lp.token_id): {
                    "logprob": lp.logprob,
                    "rank": lp.rank,
                    "decoded_token": self.token_text(lp.token_id),
                }
            }
            for rank, (tid, value) in enumerate(lp.top, 1):
                entry.setdefault(
                    str(tid),
                    {"logprob": value, "rank": rank, "decoded_token": self.token_text(tid)},
                )
            field_.append(entry)
        return field_

    def chunk(
        self, choices: list[dict[str, Any]], usage=None, include_usage=False
    ) -> dict[str, Any]:
        obj = {
            "id": self.response_id,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.model_name,
            "choices": choices,
        }
        if include_usage:
            obj["usage"] = usage
        return obj

    @property
    def response_id(self) -> str:
        return self.id_prefix + self.request_id

    def usage(
        self,
        choices: list[Choice],
        completion_tokens: list[int],
        cached: list[int],
        by_medium: list[dict[str, int] | None] | None = None,
    ) -> dict[str, Any]:
        """Prompt and cached tokens once per prompt (its first choice), completion tokens of all;
        ``by_medium``: per choice index, its cached tokens by tier (engines with KV tiers)."""
        first: dict[int, Choice] = {}
        for c in choices:
            first.setdefault(c.prompt_index, c)
        # a continuation's cache hit may reach into its resumed ids: only the prompt's part counts
        split = None
        if by_medium is not None and any(by_medium[c.index] is not None for c in first.values()):
            split = {m: 0 for m in MEDIA}
            for c in first.values():
                for m, n in capped_by_medium(by_medium[c.index] or {}, len(c.ids)).items():
                    split[m] += n
        return usage_field(
            sum(len(c.ids) for c in first.values()),
            sum(completion_tokens),
            sum(min(cached[c.index], len(c.ids)) for c in first.values()),
            split,
        )

    def with_token_ids(
        self,
        choice: dict[str, Any],
        c: Choice,
        token_ids: list[int],
        first: bool,
        obj: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """return_token_ids (vLLM's): the choice's ``token_ids``, and the prompt's ids with the first
        output (on the choice for completions, on ``obj`` - the response or chunk - for chat);
        never on a continuation's choice that goes on from ids, whose client has them already."""
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
            if first and not (c.resumed and self.streaming):
                if self.prompt_ids_per_choice:
                    choice["prompt_token_ids"] = list(c.ids)
                elif obj is not None:
                    obj["prompt_token_ids"] = list(c.ids)
        return choice

    def full_response(self, choices: list[Choice], outs: list[RequestOutput]) -> dict[str, Any]:
        items, generated = [], []
        response = {
            "id": self.response_id,
            "object": self.response_object,
            "created": self.created,
            "model": self.model_name,
            "choices": items,
        }
        for c, out in zip(choices, outs):
            comp, want_lp = out.outputs[0], c.params.logprobs is not None
            text, lps, finish, ids = (
                comp.text,
                comp.logprobs or [],
                comp.finish_reason,
                comp.token_ids,
            )
            if self.echo_only:  # the prompt alone: the one token generated is dropped
                text, lps, finish, ids = "", [], "length", []
            generated.append(0 if self.echo_only else len(comp.token_ids) + len(c.resumed))
            item = self.full_choice(c, out, text, lps, finish, want_lp)
            if self.with_prompt_logprobs:
                item["prompt_logprobs"] = self.prompt_logprobs_field(out)
            items.append(
                self.with_token_ids(
                    item, c, ids, first=c.index == 0 or self.prompt_ids_per_choice, obj=response
                )
            )
        cached = [0] * (choices[-1].index + 1)  # by choice index, as usage() reads it
        by_medium: list[dict[str, int] | None] = [None] * len(cached)
        for c, out in zip(choices, outs):
            cached[c.index] = out.num_cached_tokens
            by_medium[c.index] = out.num_cached_tokens_by_medium
        response["usage"] = self.usage(choices, generated, cached, by_medium)
        return response

    def response_size(self, choices: list[Choice], outs: list[RequestOutput]) -> int:
        """About how many token entries full_response builds: tokens times their top-N logprobs."""
        size = 0
        for c, out in zip(choices, outs):
            tokens = len(out.outputs[0].token_ids) + (
                len(c.ids) if self.echo or self.with_prompt_logprobs else 0
            )
            size += tokens * (1 + (c.params.logprobs or 0) + (c.params.prompt_logprobs or 0))
        return size

    def json_response(self, choices: list[Choice], outs: list[RequestOutput]) -> JSONResponse:
        return JSONResponse(self.full_response(choices, outs), headers=self.headers)
