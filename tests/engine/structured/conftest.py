import functools

import pytest


@functools.lru_cache(maxsize=1)
def _tokenizer_and_info():
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from kvmesh.engine.builtin import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir("smollm2-135m-instruct")))
    return tok, xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))


@pytest.fixture(scope="session")
def tokenizer():
    return _tokenizer_and_info()[0]


@pytest.fixture(scope="session")
def tokenizer_info():
    return _tokenizer_and_info()[1]
