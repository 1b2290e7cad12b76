"""Shared pieces of the seam tests (tests/test_seams_*.py): a tiny random-weight engine with a
real byte-level BPE tokenizer, real Redis, real sidecars, and checks on KV-event chains.

The tokenizer is the built-in SmolLM2 one when it is on disk already (no model conversion is
started for it); otherwise a small byte-level BPE is trained here, so the tests never need the
slow model. Either way it is a tokenizer whose ids on non-ASCII text differ from a naive split
(`check_tokenizer_is_not_naive`).
"""

from __future__ import annotations

import json
from pathlib import Path

from kvmesh.common.block_keys import block_key, root_key
from kvmesh.common.kv_events import BlockStored

# The built-in model's template (SmolLM2's), used with the trained tokenizer too.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. A KV cache keeps keys and values of past tokens.",
    "naïve résumé café über Straße façade coöperate élan déjà vu jalapeño piñata São Paulo Zürich",
    "日本語のテキスト 中文文本 한국어 텍스트 Ελληνικά кириллица עברית العربية हिन्दी",
    "emoji 👍🏽 👩‍👩‍👧 🇫🇷 🎉 ✨ and combining marks e\u0301 n\u0303 a\u0308",
    "def block_key(parent, tokens): return sha256(parent || tokens)[:8]  # 0123456789",
    "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\nHi there.<|im_end|>\n",
]


def trained_tokenizer_dir(path: Path) -> Path:
    """A small byte-level BPE (GPT-2 style pre-tokenizer, no normalizer) with SmolLM2's special
    tokens at the same ids (0, 1, 2) and its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path.mkdir(parents=True, exist_ok=True)
    if (path / "tokenizer.json").exists():
        return path
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1200,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "pad_token": "<|im_end|>",
                "unk_token": "<|endoftext|>",
            }
        )
    )
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return path


def tokenizer_source(tmp: Path) -> Path:
    """SmolLM2's tokenizer files if converted already, else the trained one (also with
    KVMESH_SEAMS_TOKENIZER=bpe, to run the seam tests on it)."""
    import os

    from kvmesh.common.model_lookup import find_model_dir

    if os.environ.get("KVMESH_SEAMS_TOKENIZER") == "bpe":
        return trained_tokenizer_dir(tmp / "bpe-tokenizer")
    try:
        return find_model_dir("smollm2-135m-instruct")  # on disk already: no conversion
    except FileNotFoundError:
        return trained_tokenizer_dir(tmp / "bpe-tokenizer")


def build_seam_model(tmp: Path) -> str:
    from tests.tiny_models import build_tiny_model

    return str(
        build_tiny_model(
            tmp / "tiny-llama-plain", "tiny-llama-plain", tokenizer_source=tokenizer_source(tmp)
        )
    )


def check_tokenizer_is_not_naive(model_dir: str) -> None:
    """The engine's tokenizer merges non-ASCII letters with their ASCII neighbours (one \\p{L}
    run), which the router's ASCII-only fast path would not: so text like "naïve" exercises the
    router's fallback, and a router that skipped it would compute other block keys."""
    from kvmesh.common.tokenizer import KVMeshTokenizer
    from kvmesh.router.fast_tokenize import FastEncoder

    tok = KVMeshTokenizer(model_dir)
    fast = FastEncoder(tok)
    assert fast.fast, "the seam tests need a byte-level BPE the router's fast path handles"
    naive: list[int] = []
    fast._encode_ascii("naïve résumé", naive)
    assert naive != tok.encode("naïve résumé")


def chain_errors(events, model: str, block_size: int, cache_salt: str | None = None) -> list[str]:
    """Every BlockStored must be one continuous chain: recomputing the keys from its parent (the
    root of the model, and salt, for None) and its token ids, as a vLLM-format consumer does,
    gives its hashes. Returns the events that are not (an empty list when all are)."""
    root = root_key(model, cache_salt)
    bad = []
    for ev in events:
        if not isinstance(ev, BlockStored):
            continue
        parent = root if ev.parent_block_hash is None else ev.parent_block_hash
        keys = []
        for i in range(len(ev.block_hashes)):
            parent = block_key(parent, ev.token_ids[i * block_size : (i + 1) * block_size])
            keys.append(parent)
        if keys != list(ev.block_hashes):
            bad.append(
                f"BlockStored parent={ev.parent_block_hash} hashes={ev.block_hashes}: recomputed {keys}"
            )
    return bad
