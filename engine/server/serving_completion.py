"""``POST /v1/completions`` (vLLM's ``serving_completion.py``): prompts as text or token ids,
several prompts per request, ``echo`` and the completion API's logprobs (tokens, token_logprobs,
top_logprobs, text_offset)."""

from __future__ import annotations

from typing import Any

from kvmesh.engine.outputs import RequestOutput
from kvmesh.engine.server.choices import Choice
from kvmesh.engine.server.off_loop import off_loop
from kvmesh.engine.server.protocol import CompletionRequest
from kvmesh.engine.server.serving_base import GenerationHandler


class CompletionHandler(GenerationHandler):
    request_model = CompletionRequest
    prompt_param = "prompt"
    id_prefix = "cmpl-"
    response_object = "text_completion"
    chunk_object = "text_completion"
    prompt_ids_per_choice = True  # return_token_ids: each choice has its prompt's ids (as vLLM)

    def __init__(self, state, request):
        super().__init__(state, request)
        self.text_offsets: dict[int, int] = {}  # per streamed choice: the characters sent so far

    def prompts(self, body: CompletionRequest) -> list[str | list[int]]:
        return body.prompt_inputs()

    async def tokenize_prompt(self, body: CompletionRequest, prompt: str | list[int]):
        ids = (
            await off_loop(len(prompt), self.engine.tokenizer.encode, prompt)
            if isinstance(prompt, str)
            else list(prompt)
        )
        return prompt, ids

    def read_options(self, body: CompletionRequest) -> None:
        self.echo = body.echo
        self.echo_only = body.echo_only

    def completion_logprobs(
        self, lps, offset: int, prompt: list[tuple[int, Any]] = ()
    ) -> dict[str, Any]:
        """OpenAI's completion logprobs; with echo, the prompt's (token id, logprob or None) first."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, lp in [*prompt, *((lp.token_id, lp) for lp in lps)]:
            text = self.token_text(tid)
            tokens.append(text)
            token_lps.append(lp.logprob if lp is not None else None)
            tops.append({self.token_text(t): v for t, v in lp.top} if lp is not None else None)
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def echo_prefix(self, c: Choice, out: RequestOutput) -> tuple[str, list[tuple[int, Any]]]:
        """The prompt's text and its (token id, logprob) entries, for echo."""
        text = (
            c.prompt
            if isinstance(c.prompt, str)
            else self.engine.tokenizer.decode(
                c.ids, skip_special_tokens=c.params.skip_special_tokens
            )
        )
        lps = out.prompt_logprobs or [None] * len(c.ids)
        return text, list(zip(c.ids, lps))

    def stream_prefix(self, c: Choice, out: RequestOutput, first: bool):
        # a continuation's choice the client has ids of had its echo (one started from nothing: not)
        return self.echo_prefix(c, out) if self.echo and first and not c.resumed else ("", [])

    def stream_choice(self, c, out, prefix, prompt_entries, delta_text, delta_lps, finish, want_lp):
        i = c.index
        offset = self.text_offsets.get(i)
        if offset is None:  # a continuation's: after the text the client has (its echo too)
            offset = out.outputs[0].text_offset
            if self.echo and c.resumed:
                offset += len(self.echo_prefix(c, out)[0])
        text = prefix + delta_text
        choice = {
            "index": i,
            "text": text,
            "logprobs": self.completion_logprobs(delta_lps, offset, prompt_entries)
            if want_lp
            else None,
            "finish_reason": finish,
            "stop_reason": out.outputs[0].stop_reason if finish else None,
        }
        self.text_offsets[i] = offset + len(text)
        return choice

    def full_choice(self, c, out, text, lps, finish, want_lp):
        prefix, prompt_entries = (
            self.echo_prefix(c, out) if self.echo and not c.resumed else ("", [])
        )
        return {
            "index": c.index,
            "text": prefix + text,
            "logprobs": (
                self.completion_logprobs(lps, out.outputs[0].text_offset, prompt_entries)
                if want_lp
                else None
            ),
            "finish_reason": finish,
            "stop_reason": out.outputs[0].stop_reason,
        }
