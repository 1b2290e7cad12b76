"""The offline API, shaped like vLLM's: LLM(model, **engine_args).generate(prompts, params)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from kvmesh.common.model_lookup import DEFAULT_MODEL
from kvmesh.engine.config import EngineArgs
from kvmesh.engine.llm_engine import LLMEngine, PromptType
from kvmesh.engine.lora.offline import adapter_names
from kvmesh.engine.lora.request import LoRARequest
from kvmesh.engine.outputs import RequestOutput
from kvmesh.engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_args: Any):
        self.engine = LLMEngine(EngineArgs.from_kwargs(model, **engine_args))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(args)
        return llm

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() uses without sampling params: the model's generation-config defaults
        (engine arg ``generation_config``), else SamplingParams()."""
        return self.engine.default_sampling_params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        cache_salt: str | None = None,
        resume_token_ids: list[list[int]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """``resume_token_ids``: per prompt, the output a continuation starts after (generated
        before, elsewhere; n must be 1): its outputs hold what follows them only.
        ``lora_request``: the adapter every prompt runs with, or one per prompt (None: the base),
        loaded on first use (``enable_lora``). ``priority``: one per prompt, lower first, as
        vLLM's (the ``priority`` scheduling policy only)."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # a single prompt (text or token ids)
        prompts = list(prompts)
        resumed = list(resume_token_ids) if resume_token_ids is not None else [None] * len(prompts)
        if len(resumed) != len(prompts):
            raise ValueError(f"{len(resumed)} resume_token_ids lists for {len(prompts)} prompts")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"{len(priorities)} priorities for {len(prompts)} prompts")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        # Validate every prompt before any is queued: nothing half-submitted on bad input.
        tokenized = [self.engine.tokenize_prompt(p) for p in prompts]
        for (_, ids), sp, done in zip(tokenized, params, resumed):
            self.engine.core.validate_prompt(ids)
            self.engine.core.validate_params(sp)
            if done is not None:
                self.engine.core.limits.validate_resume(ids, done, sp)
            self.engine.core.check_structured(
                sp
            )  # a spec the backend refuses: before anything runs
        adapters = adapter_names(self.engine.core, lora_request, len(prompts))
        order: dict[str, tuple[int, int]] = {}  # engine request -> (prompt, sample)
        for i, ((text, ids), sp) in enumerate(zip(tokenized, params)):
            for j in range(sp.n):
                # n samples of a prompt: n requests (the later ones hit the first's prompt blocks)
                rid = self.engine.add_request(
                    text if text is not None else ids,
                    sp.sample(j),
                    cache_salt=cache_salt,
                    prompt_token_ids=ids,
                    resume_token_ids=resumed[i],
                    lora_name=adapters[i],
                    priority=priorities[i],
                )
                order[rid] = (i, j)
        return self._run(order, len(prompts), use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            self.engine.apply_chat_template(
                c, add_generation_prompt, continue_final_message, chat_template_kwargs
            )
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(
        self, order: dict[str, tuple[int, int]], num_prompts: int, use_tqdm: bool
    ) -> list[RequestOutput]:
        samples: list[dict[int, RequestOutput]] = [{} for _ in range(num_prompts)]
        bar = tqdm(total=len(order), desc="generating", unit="req", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished and out.request_id in order:
                    i, j = order[out.request_id]
                    samples[i][j] = out
                    bar.update()
        bar.close()
        results = []
        for outs in samples:  # one RequestOutput per prompt, its n samples in outputs[0..n-1]
            first = outs[0]
            if len(outs) > 1:
                first = replace(
                    first, outputs=[replace(outs[j].outputs[0], index=j) for j in range(len(outs))]
                )
            results.append(first)
        return results

    def stats(self):
        return self.engine.core.stats()
