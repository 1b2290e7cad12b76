"""Exact, faster tokenization for the router's hot path.

The router must produce exactly the token ids the engine produces (block keys are
computed from them), and it must do so in well under a millisecond for a 2,000-token
prompt. Hugging Face `tokenizers` spends most of its time in the byte-level
pre-tokenizer's regex (Oniguruma) and in building offsets, about 2 µs a token here.

For byte-level BPE tokenizers (GPT-2 family, SmolLM2, Llama 3, Qwen ...) without a
normalizer, encoding is a pure function of the pre-tokenized pieces:

    text -> split on added tokens -> GPT-2 regex pieces -> BPE(each piece)

so for ASCII text (where Python's `re` with explicit classes is the same regex) we split
with `re`, look each piece up in a word cache, and BPE only unseen pieces through the
same `tokenizers` model. Anything else (non-ASCII text, other tokenizer types) takes the
regular `KVMeshTokenizer.encode`. tests/router/test_fast_tokenize.py checks equality
against the regular path with hypothesis.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvmesh.common.tokenizer import KVMeshTokenizer

_WS = r"\t\n\x0b\x0c\r "
# tokenizers' ByteLevel regex, `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`,
# restricted to ASCII (where \p{L} = [A-Za-z], \p{N} = [0-9], \s = Unicode White_Space).
_ASCII_PIECES = re.compile(
    rf"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^{_WS}A-Za-z0-9]+|[{_WS}]+(?![^{_WS}])|[{_WS}]+"
)


class FastEncoder:
    def __init__(self, tokenizer: KVMeshTokenizer, cache_size: int = 500_000):
        self.tok = tokenizer
        self.cache_size = cache_size
        self._cache: dict[str, list[int]] = {}
        self._special_ids: dict[str, int] = {}
        self._special_re: re.Pattern[str] | None = None
        self._bpe = None
        self.fast = self._setup()

    def _setup(self) -> bool:
        from tokenizers import Tokenizer, pre_tokenizers

        try:
            spec: dict[str, Any] = json.loads(self.tok.tokenizer.to_str())
        except Exception:  # noqa: BLE001
            return False
        pre = spec.get("pre_tokenizer") or {}
        model = spec.get("model") or {}
        if spec.get("normalizer") is not None or model.get("type") != "BPE" or model.get("dropout"):
            return False
        if pre.get("type") != "ByteLevel" or not pre.get("use_regex", True) or pre.get("add_prefix_space"):
            return False
        for added in spec.get("added_tokens") or []:
            if added.get("normalized") or added.get("lstrip") or added.get("rstrip") or added.get("single_word"):
                return False
            if not added["content"].isascii():
                return False
            self._special_ids[added["content"]] = added["id"]
        # The post-processor must not add tokens (the engine's encode(add_special_tokens=True)
        # would then differ); check it by behaviour.
        t = self.tok.tokenizer
        if t.encode("a b", add_special_tokens=True).ids != t.encode("a b", add_special_tokens=False).ids:
            return False
        if self._special_ids:
            alternatives = sorted(self._special_ids, key=len, reverse=True)
            self._special_re = re.compile("(" + "|".join(re.escape(a) for a in alternatives) + ")")
        self._bpe = Tokenizer.from_str(t.to_str())
        self._bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return True

    def _encode_pieces(self, pieces: list[str], out: list[int]) -> None:
        cache = self._cache
        missing = [p for p in dict.fromkeys(pieces) if p not in cache]
        if missing:
            if len(cache) + len(missing) > self.cache_size:
                cache.clear()
            # One sequential encode of the unseen pieces as pre-tokenized words (the batch API
            # would wake a thread pool: slower for a handful of words on a busy machine).
            enc = self._bpe.encode(missing, is_pretokenized=True, add_special_tokens=False)
            split: list[list[int]] = [[] for _ in missing]
            for tid, w in zip(enc.ids, enc.word_ids):
                split[w].append(tid)
            for p, ids in zip(missing, split):
                cache[p] = ids
        for p in pieces:
            out.extend(cache[p])

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not self.fast or not text.isascii():
            return self.tok.encode(text, add_special_tokens=add_special_tokens)
        out: list[int] = []
        if self._special_re is None:
            self._encode_pieces(_ASCII_PIECES.findall(text), out)
            return out
        for i, part in enumerate(self._special_re.split(text)):
            if i % 2:
                out.append(self._special_ids[part])
            elif part:
                self._encode_pieces(_ASCII_PIECES.findall(part), out)
        return out

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None
                    ) -> list[int]:
        return self.encode(self.tok.render_chat(messages, add_generation_prompt, continue_final_message,
                                                template_kwargs), add_special_tokens=False)
