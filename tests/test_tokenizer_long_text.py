"""KVMeshTokenizer's long texts go through the tokenizers batch API (which releases the GIL, so an
event loop in another thread keeps running): the same ids and text as the direct calls."""

import pytest

from kvmesh.common.tokenizer import LONG_TEXT_CHARS, KVMeshTokenizer
from kvmesh.engine.builtin import resolve_model_dir


@pytest.fixture(scope="module")
def tok():
    return KVMeshTokenizer(resolve_model_dir("smollm2-135m-instruct"))


@pytest.mark.parametrize("size", [LONG_TEXT_CHARS - 1, LONG_TEXT_CHARS, 50_000])
@pytest.mark.parametrize("special", [True, False])
def test_long_text_ids_equal_the_direct_encode(tok, size, special):
    text = ("Straße über café, <|im_start|> 日本語 and 42 ASCII words. " * (size // 40 + 1))[:size]
    ids = tok.encode(text, add_special_tokens=special)
    assert ids == tok.tokenizer.encode(text, add_special_tokens=special).ids
    assert tok.decode(ids) == tok.tokenizer.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == tok.tokenizer.decode(
        ids, skip_special_tokens=False
    )
