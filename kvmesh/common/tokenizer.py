"""Tokenization shared by engine and router, so both see the same token ids.

Built on `tokenizers` and jinja2 only (no transformers, no torch): the router
computes block keys from exactly the ids the engine will compute. Chat
templates render the way Hugging Face renders them (sandboxed jinja2,
trim_blocks, lstrip_blocks), and the rendered text is encoded without adding
special tokens again, as transformers and vLLM do.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer


class TemplateError(ValueError):
    pass


# From this length on, encode() and decode() go through the tokenizers batch API, which releases
# the GIL: a 4 MB prompt (seconds of Rust) then leaves an asyncio loop in another thread free to
# answer. Shorter texts skip the batch API's thread-pool hand-off (about 0.25 ms).
LONG_TEXT_CHARS = 4096

_RESERVED_TEMPLATE_VARS = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})


def _raise_exception(message: str):
    raise TemplateError(message)


def _token_text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict):  # AddedToken serialised form
        return value.get("content")
    return str(value)


class KVMeshTokenizer:
    """A fast tokenizer plus its chat template, loaded from a Hugging Face directory."""

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
        self.tokenizer = Tokenizer.from_file(str(path))
        config: dict[str, Any] = {}
        if (model_dir / "tokenizer_config.json").exists():
            config = json.loads((model_dir / "tokenizer_config.json").read_text())
        self.chat_template: str | None = config.get("chat_template")
        if self.chat_template is None and (model_dir / "chat_template.jinja").exists():
            self.chat_template = (model_dir / "chat_template.jinja").read_text()
        if isinstance(self.chat_template, list):  # named templates: take "default"
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()))
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.eos_token_ids: set[int] = set()
        for source in (config, self._generation_config(model_dir)):
            eos = source.get("eos_token_id")
            for tid in eos if isinstance(eos, list) else [eos]:
                if isinstance(tid, int):
                    self.eos_token_ids.add(tid)
        if self.eos_token is not None and self.tokenizer.token_to_id(self.eos_token) is not None:
            self.eos_token_ids.add(self.tokenizer.token_to_id(self.eos_token))
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self._template = None

    @staticmethod
    def _generation_config(model_dir: Path) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for name in ("config.json", "generation_config.json"):
            if (model_dir / name).exists():
                data = json.loads((model_dir / name).read_text())
                if data.get("eos_token_id") is not None:
                    merged["eos_token_id"] = data["eos_token_id"]
        return merged

    @property
    def eos_token_id(self) -> int | None:
        return min(self.eos_token_ids) if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if (
            len(text) >= LONG_TEXT_CHARS
        ):  # the batch API runs without the GIL: other threads keep running
            return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if len(ids) >= LONG_TEXT_CHARS // 4:
            return self.tokenizer.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.id_to_token(i) or "" for i in ids]

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The chat template applied. ``continue_final_message`` (vLLM's) leaves the final message
        open, so the model continues it; ``template_kwargs`` reach the template as variables."""
        template_kwargs = template_kwargs or {}
        if continue_final_message and add_generation_prompt:
            raise TemplateError(
                "continue_final_message and add_generation_prompt cannot both be true"
            )
        clash = sorted(_RESERVED_TEMPLATE_VARS & template_kwargs.keys())
        if clash:
            raise TemplateError(f"chat_template_kwargs may not set {', '.join(clash)}")
        if not self.chat_template:
            raise TemplateError(
                "this model has no chat template; use /v1/completions with a plain prompt"
            )
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
                x, indent=indent, ensure_ascii=ensure_ascii
            )
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        text = self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **template_kwargs,
        )
        if continue_final_message:  # cut what the template put after the final message's content
            last = messages[-1].get("content") if messages else None
            at = text.rfind(last) if isinstance(last, str) and last else -1
            if at < 0:
                raise TemplateError(
                    "continue_final_message: the final message's content is not in the "
                    "rendered prompt (is it empty?)"
                )
            text = text[: at + len(last)]
        return text

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        # The template already contains the special tokens it wants.
        return self.encode(
            self.render_chat(
                messages, add_generation_prompt, continue_final_message, template_kwargs
            ),
            add_special_tokens=False,
        )
