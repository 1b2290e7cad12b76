"""A generation request's choices: one engine request per (prompt, sample), fitted to the context."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvmesh.engine.model_limits import RESUME_PARAM, ResumeTooLong
from kvmesh.engine.sampling_params import InvalidParameter, SamplingParams
from kvmesh.engine.server.async_engine import AsyncEngine, RequestStream
from kvmesh.engine.server.errors import bad_request
from kvmesh.engine.server.off_loop import off_loop


@dataclass
class Choice:
    """One engine request of an HTTP request: choice ``index`` (the response's), of prompt ``prompt_index``."""

    index: int
    prompt_index: int
    prompt: str | list[int]
    ids: list[int]
    params: SamplingParams
    stream: RequestStream | None = None
    resumed: list[int] = field(default_factory=list)  # a continuation's ids already sent (resume)


def fit_max_tokens(
    body, ids: list[int], params: SamplingParams, max_len: int, prompt_param: str
) -> SamplingParams:
    """``params`` with a ``max_tokens`` that fits the context after the prompt ``ids``, or the 400 that
    says what does not fit (``prompt_param``: the field the request names its prompt in)."""
    room = max_len - len(ids)
    if params.max_tokens is None or len(ids) + params.max_tokens <= max_len:
        if (
            params.min_tokens > room
        ):  # no max_tokens: the context bounds the output, below min_tokens
            raise bad_request(
                f"This model's maximum context length is {max_len} tokens. However, you requested at "
                f"least {len(ids) + params.min_tokens} tokens ({len(ids)} in the {prompt_param}, min_tokens "
                f"{params.min_tokens}). Please reduce the length of the {prompt_param} or min_tokens.",
                param="min_tokens",
                code="context_length_exceeded",
            )
        return params
    if body.requested_max_tokens() is None and room >= max(1, params.min_tokens):
        # The model's default (max_new_tokens), not the client's ask: shorten it to fit.
        return replace(params, max_tokens=room)
    # the client's max_tokens (as it named it), or else its min_tokens, does not fit
    param = (
        body.request_param("max_tokens")
        if body.requested_max_tokens() is not None
        else "min_tokens"
    )
    raise bad_request(
        f"This model's maximum context length is {max_len} tokens. However, you "
        f"requested {len(ids) + params.max_tokens} tokens ({len(ids)} in the "
        f"{prompt_param}, {params.max_tokens} in the completion). Please reduce the length "
        f"of the {prompt_param} or the completion.",
        param=param,
        code="context_length_exceeded",
    )


async def validate_resume(
    engine: AsyncEngine,
    ids: list[int],
    sample: SamplingParams,
    so_far: list[int],
    where: str | None,
) -> None:
    """A continued choice's ids; ``where``: its entry in resume.choices (None: the one-choice
    form), which the error then names."""
    try:
        await off_loop(len(ids) + len(so_far), engine.validate, ids, sample, so_far)
    except InvalidParameter as exc:
        if where is None or exc.param != RESUME_PARAM:
            raise
        param = f"{where}.output_token_ids"
        message = str(exc).replace(RESUME_PARAM, param)
        renamed = (
            ResumeTooLong(message, exc.context)
            if isinstance(exc, ResumeTooLong)
            else InvalidParameter(param, message)
        )
        renamed.param = param
        raise renamed from None
