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


LARGE_CHUNK = 32 * 1024
_CUT = re.compile(r"(?<=[!-~]) (?=[!-~])")


def safe_chunks(text: str, size: int) -> list[str]:
    r"""`text` cut into pieces of about `size` characters, each cut just before a space that sits
    between two printable ASCII characters. The byte-level pre-tokenizer's pieces never span such
    a cut: no piece holds a non-space character followed by a space (runs of letters, digits or
    other symbols stop at whitespace), and a space followed by a non-space character always
    starts a new ` X...` piece; the only lookahead (`\s+(?!\S)`) is for whitespace runs, which
    cannot end just before the cut. So encoding the pieces one by one gives the ids of the whole."""
    if len(text) <= size:
        return [text]
    out: list[str] = []
    start = 0
    while len(text) - start > size:
        m = _CUT.search(text, start + size)
        if m is None:
            break
        out.append(text[start : m.start()])
        start = m.start()
    out.append(text[start:])
    return out


class FastEncoder:
    def __init__(self, tokenizer: KVMeshTokenizer, cache_size: int = 500_000):
        self.tok = tokenizer
        self.cache_size = cache_size
        self._cache: dict[str, list[int]] = {}
        self._special_ids: dict[str, int] = {}
        self._special_re: re.Pattern[str] | None = None
        self._bpe = None
        self._special_cuttable = False
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
        if (
            pre.get("type") != "ByteLevel"
            or not pre.get("use_regex", True)
            or pre.get("add_prefix_space")
        ):
            return False
        for added in spec.get("added_tokens") or []:
            if (
                added.get("normalized")
                or added.get("lstrip")
                or added.get("rstrip")
                or added.get("single_word")
            ):
                return False
            if not added["content"].isascii():
                return False
            self._special_ids[added["content"]] = added["id"]
        # The post-processor must not add tokens (the engine's encode(add_special_tokens=True)
        # would then differ); check it by behaviour.
        t = self.tok.tokenizer
        if (
            t.encode("a b", add_special_tokens=True).ids
            != t.encode("a b", add_special_tokens=False).ids
        ):
            return False
        self._special_cuttable = any(_CUT.search(s) for s in self._special_ids)
        if self._special_ids:
            alternatives = sorted(self._special_ids, key=len, reverse=True)
            self._special_re = re.compile("(" + "|".join(re.escape(a) for a in alternatives) + ")")
        self._bpe = Tokenizer.from_str(t.to_str())
        self._bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return True

    def _encode_pieces(self, pieces: list[str], out: list[int]) -> None:
        # Safe while a worker thread encodes a long prompt (encode_large) and the event loop a
        # short one: a full cache is replaced, never cleared under the other's feet, and the
        # pieces just encoded are read from `new`, not from the shared cache.
        cache = self._cache
        new: dict[str, list[int]] = {}
        missing = [p for p in dict.fromkeys(pieces) if p not in cache]
        if missing:
            # One sequential encode of the unseen pieces as pre-tokenized words (the batch API
            # would wake a thread pool: slower for a handful of words on a busy machine).
            enc = self._bpe.encode(missing, is_pretokenized=True, add_special_tokens=False)
            split: list[list[int]] = [[] for _ in missing]
            for tid, w in zip(enc.ids, enc.word_ids):
                split[w].append(tid)
            new = dict(zip(missing, split))
            if len(cache) + len(new) > self.cache_size:
                self._cache = {}
            self._cache.update(new)
        for p in pieces:
            ids = new.get(p) if new else None
            out.extend(ids if ids is not None else cache[p])

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not self.fast or not text.isascii():
            return self.tok.encode(text, add_special_tokens=add_special_tokens)
        out: list[int] = []
        self._encode_ascii(text, out)
        return out

    def encode_large(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The same ids as encode(), for a long text in a worker thread, without holding the GIL for
        long: the text is cut where no pre-tokenizer piece can span (a space between two ASCII
        letters ends one piece and starts the next), and each cut is encoded alone, ASCII by the
        fast path, the rest by `tokenizers` (which runs without the GIL). So the event loop keeps
        answering other clients while a 4 MB prompt is tokenised."""
        if not self.fast:
            return self.tok.encode(text, add_special_tokens=add_special_tokens)
        out: list[int] = []
        if self._special_cuttable:  # a special token could straddle a cut: split them out first
            parts = self._special_re.split(text)
            chunks = [
                (i % 2 == 1, c)
                for i, part in enumerate(parts)
                for c in ([part] if i % 2 else safe_chunks(part, LARGE_CHUNK))
            ]
        else:
            chunks = [(False, c) for c in safe_chunks(text, LARGE_CHUNK)]
        for special, chunk in chunks:
            if special:
                out.append(self._special_ids[chunk])
            elif not chunk:
                continue
            elif chunk.isascii():
                self._encode_ascii(chunk, out)
            else:  # tokenizers splits the added tokens itself, and runs without the GIL
                out.extend(
                    self.tok.tokenizer.encode_batch([chunk], add_special_tokens=False)[0].ids
                )
        return out

    def _encode_ascii(self, text: str, out: list[int]) -> None:
        if self._special_re is None:
            self._encode_pieces(_ASCII_PIECES.findall(text), out)
            return
        for i, part in enumerate(self._special_re.split(text)):
            if i % 2:
                out.append(self._special_ids[part])
            elif part:
                self._encode_pieces(_ASCII_PIECES.findall(part), out)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        large: bool = False,
    ) -> list[int]:
        """`large`: the conversation is long and this runs in a worker thread (see encode_large)."""
        text = self.tok.render_chat(
            messages, add_generation_prompt, continue_final_message, template_kwargs
        )
        return (self.encode_large if large else self.encode)(text, add_special_tokens=False)
