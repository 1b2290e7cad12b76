"""Text in, text out: tokenizer + engine core + per-request output state.

``TextEngine`` is the text side alone (tokenizer, per-request detokenizer and stop strings);
``LLMEngine`` adds the engine core in this process. The API process of a server whose core runs
in its own process uses a ``TextEngine`` (engine/server/core_client.py ``FrontendEngine``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from kvmesh.common.cache_salt import InvalidCacheSalt, check_cache_salt
from kvmesh.common.tokenizer import KVMeshTokenizer, TemplateError
from kvmesh.engine.config import EngineArgs
from kvmesh.engine.detokenizer import IncrementalDetokenizer
from kvmesh.engine.engine_core import EngineCore, EngineCoreOutput
from kvmesh.engine.generation_defaults import load_sampling_defaults
from kvmesh.engine.outputs import CompletionOutput, RequestOutput
from kvmesh.engine.sampling_params import InvalidParameter, SamplingParams, check_text

PromptType = str | list[int]


@dataclass
class _RequestState:
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    output: CompletionOutput
    prompt_logprobs: list | None = None


class TextEngine:
    """The text side of an engine: tokenizer, generation-config defaults, per-request state."""

    def __init__(self, model_dir, generation_config: str | None):
        self.tokenizer = KVMeshTokenizer(model_dir)
        self.sampling_defaults = load_sampling_defaults(generation_config, model_dir)
        self.states: dict[str, _RequestState] = {}
        self._ids = itertools.count()

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation-config defaults applied."""
        return SamplingParams(**self.sampling_defaults)

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidParameter(
                    "prompt", "prompt is empty: it must contain at least one token"
                )
            check_text("prompt", prompt)
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            return None, list(prompt)
        raise InvalidParameter("prompt", "prompt must be a string or a list of token ids")

    def create_state(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        prompt_token_ids: list[int] | None = None,
        resumed_token_ids: list[int] | None = None,
    ) -> tuple[str, list[int], SamplingParams]:
        """The text side of a request (detokenizer, stop strings), without touching the core.

        A server keeps this on its own thread and feeds the core's outputs to
        process_output(), so detokenisation never runs on the engine thread.
        ``resumed_token_ids``: a continuation's output so far, already sent: its outputs hold
        the new text, ids and logprobs only.
        """
        params = params or self.default_sampling_params()
        request_id = request_id or f"req-{next(self._ids)}"
        if prompt_token_ids is None:
            text, prompt_token_ids = self.tokenize_prompt(prompt)
        else:
            text = prompt if isinstance(prompt, str) else None
        if params.n != 1:
            raise InvalidParameter(
                "n",
                "an engine request samples one sequence; LLM.generate and the server "
                "fan n > 1 out into n requests",
            )
        detok = IncrementalDetokenizer(
            self.tokenizer,
            prompt_token_ids,
            params.stop,
            params.include_stop_str_in_output,
            params.skip_special_tokens,
            resumed_token_ids or (),
        )
        self.states[request_id] = _RequestState(
            text,
            prompt_token_ids,
            params,
            detok,
            CompletionOutput(
                0,
                "",
                [],
                logprobs=[] if params.logprobs is not None else None,
                text_offset=detok.num_emitted_chars,
            ),
        )
        return request_id, prompt_token_ids, params

    def process_output(self, out: EngineCoreOutput) -> tuple[RequestOutput | None, bool]:
        """Detokenise one core output; (None, False) for a request no longer tracked.

        The flag says a stop string ended the request: the core does not know yet and
        must be told to abort it.
        """
        ro = self._process(out)
        return ro, ro is not None and ro.finished and out.finish_reason is None

    def _process(self, out: EngineCoreOutput) -> RequestOutput | None:
        state = self.states.get(out.request_id)
        if state is None:
            return None
        comp = state.output
        if out.prompt_logprobs is not None:
            state.prompt_logprobs = out.prompt_logprobs
        delta_text, stop_str = "", None
        new_ids, new_lps = out.new_token_ids, out.new_logprobs
        if len(new_ids) > 1 and state.params.stop:
            # Several tokens in one step (verified drafts): a stop string ends the output at the
            # token that completes it, as it would one token per step.
            for i, token in enumerate(new_ids):
                delta, stop_str = state.detok.update([token])
                delta_text += delta
                if stop_str is not None:
                    new_ids, new_lps = new_ids[: i + 1], new_lps[: i + 1]
                    break
        elif new_ids:
            delta_text, stop_str = state.detok.update(new_ids)
        if new_ids:
            comp.token_ids.extend(new_ids)
            if comp.logprobs is not None:
                comp.logprobs.extend(new_lps)
            comp.text = state.detok.new_text
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        if stop_str is not None:
            finish_reason, stop_reason = "stop", stop_str
        elif finish_reason is not None:
            delta_text += state.detok.flush()  # the end held back in case a stop string began there
        if finish_reason is not None:
            comp.finish_reason, comp.stop_reason = finish_reason, stop_reason
            del self.states[out.request_id]
        return RequestOutput(
            out.request_id,
            state.prompt,
            state.prompt_token_ids,
            [comp],
            finished=finish_reason is not None,
            num_cached_tokens=out.num_cached_tokens,
            num_cached_tokens_by_medium=out.num_cached_tokens_by_medium,
            prompt_logprobs=state.prompt_logprobs,
            delta_text=delta_text,
            delta_token_ids=list(new_ids),
            delta_logprobs=list(new_lps),
            error=out.error,
        )

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        for i, message in enumerate(messages):
            for key, value in message.items():
                if isinstance(value, str):
                    check_text(f"messages.{i}.{key}", value)
        try:
            return self.tokenizer.encode_chat(
                messages, add_generation_prompt, continue_final_message, chat_template_kwargs
            )
        except TemplateError as exc:
            raise InvalidParameter("messages", str(exc)) from None


class LLMEngine(TextEngine):
    """The text side and the engine core, in this process."""

    def __init__(self, args: EngineArgs):
        self.core = EngineCore(args)
        super().__init__(self.core.model_dir, args.generation_config)
        self.core.eos_token_ids |= self.tokenizer.eos_token_ids

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        resume_token_ids: list[int] | None = None,
        lora_name: str | None = None,
        priority: int = 0,
    ) -> str:
        """``resume_token_ids``: continue a request whose output so far is these ids (generated
        elsewhere, already delivered): its outputs hold what follows them only. ``lora_name``: a
        loaded adapter to run with (EngineCore.add_lora)."""
        try:  # the server checked it already; LLM.generate callers reach here directly
            check_cache_salt(cache_salt)
        except InvalidCacheSalt as exc:
            raise InvalidParameter("cache_salt", str(exc)) from None
        request_id, ids, params = self.create_state(
            prompt, params, request_id, prompt_token_ids, resume_token_ids
        )
        try:
            self.core.add_request(
                request_id,
                ids,
                params,
                cache_salt,
                resumed_token_ids=resume_token_ids,
                lora_name=lora_name,
                priority=priority,
            )
        except Exception:
            self.states.pop(request_id, None)
            raise
        return request_id

    def abort_request(self, request_ids) -> None:
        self.core.abort_requests(list(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        results: list[RequestOutput] = []
        stopped_by_string: list[str] = []
        for out in self.core.step():
            ro, by_stop_string = self.process_output(out)
            if ro is None:
                continue
            if by_stop_string:
                stopped_by_string.append(out.request_id)
            results.append(ro)
        if stopped_by_string:
            self.core.abort_requests(stopped_by_string, report=False)  # already finished above
        return results
