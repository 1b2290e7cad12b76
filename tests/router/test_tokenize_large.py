"""FastEncoder.encode_large (long prompts, tokenised in a worker thread in cuts that let the
event loop run) gives exactly the engine's ids; and it is safe beside the event loop's encoder."""

import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.router import fast_tokenize as ft
from tests.router.test_fast_tokenize import MIXED, encoders  # noqa: F401 - fixture

UNICODE = st.lists(
    st.one_of(
        MIXED,
        st.text(max_size=30),
        st.sampled_from(["a b", "x, y", "日本 語", "\u3000 a", "é è", "1 2", ". ,", "'s 't"]),
    ),
    max_size=20,
).map(" ".join)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=UNICODE, size=st.sampled_from([1, 3, 16, 1000]))
def test_encode_large_equals_tokenizers(encoders, text, size, monkeypatch):  # noqa: F811
    tok, fast = encoders
    monkeypatch.setattr(ft, "LARGE_CHUNK", size)  # tiny cuts: every cut point is exercised
    assert fast.encode_large(text) == tok.encode(text)
    assert fast.encode_large(text, add_special_tokens=False) == tok.encode(
        text, add_special_tokens=False
    )


def test_safe_chunks_cut_only_between_printable_characters():
    text = "alpha beta, gamma  delta\n epsilon. é ü x 1 2"
    chunks = ft.safe_chunks(text, 1)
    assert "".join(chunks) == text
    # not after a double space, a newline, or next to a non-ASCII character
    assert chunks == ["alpha", " beta,", " gamma  delta\n epsilon. é ü x", " 1", " 2"]


def test_encoders_share_their_word_cache_across_threads(encoders):  # noqa: F811
    """A worker thread encoding a long prompt and the event loop encoding short ones at once:
    the word cache is replaced when full, never cleared under the other's feet."""
    tok, fast = encoders
    fast.cache_size, saved = 50, fast.cache_size
    try:
        words = [f"w{i}x" for i in range(3000)]
        long_text = " ".join(words)
        expected_long = tok.encode(long_text)
        errors = []

        def worker():
            try:
                for _ in range(5):
                    assert fast.encode_large(long_text) == expected_long
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

        t = threading.Thread(target=worker)
        t.start()
        while t.is_alive():
            for i in range(0, 3000, 97):
                short = " ".join(words[i : i + 20])
                assert fast.encode(short) == tok.encode(short)
        t.join()
        assert errors == []
    finally:
        fast.cache_size = saved
        fast._cache = {}


@pytest.mark.parametrize("large", [False, True])
def test_chat_large_equals_engine(encoders, large):  # noqa: F811
    tok, fast = encoders
    msgs = [{"role": "user", "content": "word " * 5000 + "end"}]
    assert fast.encode_chat(msgs, large=large) == tok.encode_chat(msgs)
