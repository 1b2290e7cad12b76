"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's ``serving_tokenization.py``): the token ids
the engine would see for a prompt or chat messages (with their ``tools`` and ``tool_choice``, as the
chat handler renders them), and the text of token ids."""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi.responses import Response

from kvmesh.common.tokenizer import TemplateError
from kvmesh.engine.sampling_params import InvalidParameter
from kvmesh.engine.server.errors import bad_request
from kvmesh.engine.server.off_loop import off_loop
from kvmesh.engine.server.protocol import DetokenizeRequest, TokenizeRequest, template_message
from kvmesh.engine.server.request_body import RequestHandler
from kvmesh.engine.server.tool_prompt import chat_prompt_inputs, prompt_size


def json_response(obj: Any) -> Response:
    """The answer rendered here, not by FastAPI, whose encoder walks a list of a million token ids
    in Python on the event loop (seconds); msgspec writes it in milliseconds."""
    return Response(msgspec.json.encode(obj), media_type="application/json")


class TokenizationHandler(RequestHandler):
    """The body checks of every request (size, JSON, text, model); auth and readiness are the
    app's guard, called by the route."""

    async def tokenize(self) -> Response:
        body = await self.read_body(TokenizeRequest)
        engine = self.engine
        tok = engine.tokenizer
        try:
            body.check()
            if body.messages is not None:  # rendered as the chat handler renders it, tools included
                plan = body.tool_plan()
                messages, kwargs = chat_prompt_inputs(
                    tok.chat_template,
                    [template_message(m, i) for i, m in enumerate(body.messages)],
                    plan,
                    self.state.config.tool_call_parser,
                    body.chat_template_kwargs,
                )
                ids = await off_loop(
                    prompt_size(messages, plan),
                    tok.encode_chat,
                    messages,
                    body.add_generation_prompt,
                    body.continue_final_message,
                    kwargs,
                )
            else:
                ids = await off_loop(
                    len(body.prompt), tok.encode, body.prompt, body.add_special_tokens
                )
        except InvalidParameter as exc:
            raise bad_request(str(exc), param=exc.param)
        except TemplateError as exc:
            raise bad_request(str(exc), param="messages")
        strs = (
            await off_loop(len(ids), tok.convert_ids_to_tokens, ids)
            if body.return_token_strs
            else None
        )
        answer = {
            "count": len(ids),
            "max_model_len": engine.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }
        return await off_loop(len(ids), json_response, answer)

    async def detokenize(self) -> Response:
        body = await self.read_body(DetokenizeRequest)
        text = await off_loop(len(body.tokens), self._detokenize, body.tokens)
        return await off_loop(len(text), json_response, {"prompt": text})

    def _detokenize(self, tokens: list[int]) -> str:
        try:
            self.engine.limits.check_token_ids("tokens", tokens)
        except InvalidParameter as exc:
            raise bad_request(str(exc), param=exc.param)
        return self.engine.tokenizer.decode(tokens, skip_special_tokens=False)
