"""``POST /v1/chat/completions`` (vLLM's ``serving_chat.py``): the messages through the model's
chat template, the assistant's message (a role chunk first when streaming) and the chat API's
logprobs (content: token, logprob, bytes, top_logprobs).

Tools (``tools``, ``tool_choice``, ``parallel_tool_calls``; docs/tool-calling.md): the tools reach the
template (tool_prompt.py), ``required`` and a named function constrain the output to the tools'
schemas (tool_choice.py), and a tool parser reads each choice's output as content plus
``tool_calls``, whole or as stream deltas (tool_parsers/)."""

from __future__ import annotations

from functools import partial
from typing import Any

from kvmesh.common.tokenizer import TemplateError
from kvmesh.engine.sampling_params import InvalidParameter
from kvmesh.engine.server.choices import Choice
from kvmesh.engine.server.errors import bad_request
from kvmesh.engine.server.off_loop import off_loop
from kvmesh.engine.server.protocol import ChatCompletionRequest
from kvmesh.engine.server.serving_base import GenerationHandler
from kvmesh.engine.server.tool_choice import ToolPlan, auto_parser
from kvmesh.engine.server.tool_parsers import ToolParser
from kvmesh.engine.server.tool_prompt import chat_prompt_inputs, prompt_size


class ChatHandler(GenerationHandler):
    request_model = ChatCompletionRequest
    prompt_param = "messages"
    id_prefix = "chatcmpl-"
    response_object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, state, request):
        super().__init__(state, request)
        self.tool_plan: ToolPlan | None = None
        self.auto_parser: type[ToolParser] | None = (
            None  # the server's parser, for tool_choice auto
        )
        self._parsers: dict[int, ToolParser | None] = {}  # per choice index
        self._chunked: set[int] = (
            set()
        )  # choices that sent an output chunk (the first carries prompt logprobs)

    async def read_body(self, model_cls):
        body = await super().read_body(model_cls)
        cfg = self.state.config
        try:
            self.tool_plan = body.tool_plan()
            self.auto_parser = auto_parser(
                self.tool_plan, cfg.enable_auto_tool_choice, cfg.tool_call_parser
            )
        except InvalidParameter as exc:
            raise bad_request(str(exc), param=exc.param)
        if self.auto_parser is not None and self.auto_parser.skip_special_tokens is False:
            body.skip_special_tokens = (
                False  # the call markup is special tokens (vLLM's adjust_request)
            )
        return body

    def prompts(self, body: ChatCompletionRequest) -> list[None]:
        return [None]  # the messages, read by tokenize_prompt

    async def tokenize_prompt(self, body: ChatCompletionRequest, prompt: None):
        tokenizer = self.engine.tokenizer
        try:
            messages, kwargs = chat_prompt_inputs(
                tokenizer.chat_template,
                body.template_messages(),
                self.tool_plan,
                self.state.config.tool_call_parser,
                body.chat_template_kwargs,
            )
            ids = await off_loop(
                prompt_size(messages, self.tool_plan),
                partial(
                    tokenizer.encode_chat,
                    messages,
                    body.add_generation_prompt,
                    body.continue_final_message,
                    kwargs,
                ),
            )
        except TemplateError as exc:
            raise InvalidParameter("messages", str(exc))
        return ids, ids

    def chat_logprobs(self, lps) -> dict[str, Any]:
        content = []
        for lp in lps:
            text = self.token_text(lp.token_id)
            content.append(
                {
                    "token": text,
                    "logprob": lp.logprob,
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {
                            "token": (t := self.token_text(tid)),
                            "logprob": v,
                            "bytes": list(t.encode()),
                        }
                        for tid, v in lp.top
                    ],
                }
            )
        return {"content": content}

    # -- tool calls ---------------------------------------------------------------------------
    def parser(self, c: Choice) -> ToolParser | None:
        """Choice ``c``'s tool parser (its own: a stream's parsers keep state), or None."""
        if c.index not in self._parsers:
            plan = self.tool_plan
            parser = plan.parser(self.auto_parser) if plan is not None else None
            if (
                parser is not None and c.resumed
            ):  # a continuation: first read what the client has, silently
                parser.feed(
                    self.engine.tokenizer.decode(
                        c.resumed, skip_special_tokens=c.params.skip_special_tokens
                    )
                )
            self._parsers[c.index] = parser
        return self._parsers[c.index]

    @staticmethod
    def tool_finish(parser: ToolParser, finish: str | None, called: bool) -> str | None:
        """``tool_calls`` for an output that stopped after calling tools (auto, required; a named
        function keeps ``stop``, as vLLM and OpenAI answer)."""
        return (
            "tool_calls"
            if finish == "stop" and called and parser.finishes_with_tool_calls
            else finish
        )

    # -- choices -------------------------------------------------------------------------------
    def stream_preamble(self, choices: list[Choice]) -> list[dict[str, Any]]:
        return [
            {
                "index": c.index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for c in choices
        ]

    def stream_choice(self, c, out, prefix, prompt_entries, delta_text, delta_lps, finish, want_lp):
        parser = self.parser(c)
        if parser is None:
            delta = {"content": delta_text} if delta_text or not finish else {}
        else:
            read = parser.feed(delta_text)
            if finish:
                read += parser.finish()
            delta = {"content": read.content} if read.content else {}
            if read.calls:
                delta["tool_calls"] = [call.as_dict() for call in read.calls]
            finish = self.tool_finish(parser, finish, parser.num_calls > 0)
            # nothing to send yet: no chunk, unless it carries what the client asked for anyway
            if not (
                delta
                or finish
                or want_lp
                or self.return_token_ids
                or (self.with_prompt_logprobs and c.index not in self._chunked)
            ):
                return None
        self._chunked.add(c.index)
        choice = {
            "index": c.index,
            "delta": delta,
            "logprobs": self.chat_logprobs(delta_lps) if want_lp else None,
            "finish_reason": finish,
        }
        if finish:
            choice["stop_reason"] = out.outputs[0].stop_reason
        return choice

    def full_choice(self, c, out, text, lps, finish, want_lp):
        message: dict[str, Any] = {"role": "assistant", "content": text}
        parser = self.parser(c)
        if parser is not None:
            parsed = parser.parse(text)
            message["content"] = parsed.content
            message["tool_calls"] = [call.as_dict() for call in parsed.tool_calls]
            finish = self.tool_finish(parser, finish, bool(parsed.tool_calls))
        return {
            "index": c.index,
            "message": message,
            "logprobs": self.chat_logprobs(lps) if want_lp else None,
            "finish_reason": finish,
            "stop_reason": out.outputs[0].stop_reason,
        }
