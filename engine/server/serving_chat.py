"""``POST /v1/chat/completions`` (vLLM's ``serving_chat.py``): the messages through the model's
chat template, the assistant's message (a role chunk first when streaming) and the chat API's
logprobs (content: token, logprob, bytes, top_logprobs)."""

from __future__ import annotations

from functools import partial
from typing import Any

from kvmesh.common.tokenizer import TemplateError
from kvmesh.engine.sampling_params import InvalidParameter
from kvmesh.engine.server.protocol import ChatCompletionRequest
from kvmesh.engine.server.serving_base import Choice, GenerationHandler, off_loop


class ChatHandler(GenerationHandler):
    request_model = ChatCompletionRequest
    prompt_param = "messages"
    id_prefix = "chatcmpl-"
    response_object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def prompts(self, body: ChatCompletionRequest) -> list[None]:
        return [None]  # the messages, read by tokenize_prompt

    async def tokenize_prompt(self, body: ChatCompletionRequest, prompt: None):
        messages = body.template_messages()
        try:
            size = sum(len(m["content"]) for m in messages)
            ids = await off_loop(size, partial(self.engine.tokenizer.encode_chat, messages,
                                               body.add_generation_prompt, body.continue_final_message,
                                               body.chat_template_kwargs))
        except TemplateError as exc:
            raise InvalidParameter("messages", str(exc))
        return ids, ids

    def chat_logprobs(self, lps) -> dict[str, Any]:
        content = []
        for lp in lps:
            text = self.token_text(lp.token_id)
            content.append({"token": text, "logprob": lp.logprob, "bytes": list(text.encode()),
                            "top_logprobs": [{"token": (t := self.token_text(tid)), "logprob": v,
                                              "bytes": list(t.encode())} for tid, v in lp.top]})
        return {"content": content}

    def stream_preamble(self, choices: list[Choice]) -> list[dict[str, Any]]:
        return [{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for c in choices]

    def stream_choice(self, c, out, prefix, prompt_entries, delta_text, delta_lps, finish, want_lp):
        delta = {"content": delta_text} if delta_text or not finish else {}
        choice = {"index": c.index, "delta": delta,
                  "logprobs": self.chat_logprobs(delta_lps) if want_lp else None,
                  "finish_reason": finish}
        if finish:
            choice["stop_reason"] = out.outputs[0].stop_reason
        return choice

    def full_choice(self, c, out, text, lps, finish, want_lp):
        return {"index": c.index, "message": {"role": "assistant", "content": text},
                "logprobs": self.chat_logprobs(lps) if want_lp else None,
                "finish_reason": finish, "stop_reason": out.outputs[0].stop_reason}
