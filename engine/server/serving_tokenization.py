"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's ``serving_tokenization.py``): the token ids
the engine would see for a prompt or chat messages, and the text of token ids."""

from __future__ import annotations

from typing import Any

from kvmesh.common.tokenizer import TemplateError
from kvmesh.engine.sampling_params import InvalidParameter
from kvmesh.engine.server.errors import bad_request
from kvmesh.engine.server.protocol import DetokenizeRequest, TokenizeRequest
from kvmesh.engine.server.serving_base import RequestHandler


class TokenizationHandler(RequestHandler):
    """The body checks of every request (size, JSON, text, model); auth and readiness are the
    app's guard, called by the route."""

    async def tokenize(self) -> dict[str, Any]:
        body = await self.read_body(TokenizeRequest)
        engine = self.engine
        tok = engine.tokenizer
        try:
            body.check()
            if body.messages is not None:
                ids = tok.encode_chat([m.as_template_dict(i) for i, m in enumerate(body.messages)],
                                      body.add_generation_prompt,
                                      body.continue_final_message, body.chat_template_kwargs)
            else:
                ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        except InvalidParameter as exc:
            raise bad_request(str(exc), param=exc.param)
        except TemplateError as exc:
            raise bad_request(str(exc), param="messages")
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                "token_strs": tok.convert_ids_to_tokens(ids) if body.return_token_strs else None}

    async def detokenize(self) -> dict[str, Any]:
        body = await self.read_body(DetokenizeRequest)
        try:
            self.engine.engine.core.check_token_ids("tokens", body.tokens)
        except InvalidParameter as exc:
            raise bad_request(str(exc), param=exc.param)
        return {"prompt": self.engine.tokenizer.decode(body.tokens, skip_special_tokens=False)}
