import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvmesh.common.model_lookup import find_model_dir
from kvmesh.common.tokenizer import KVMeshTokenizer
from kvmesh.router.fast_tokenize import FastEncoder


@pytest.fixture(scope="module")
def encoders():
    tok = KVMeshTokenizer(find_model_dir("smollm2-135m-instruct"))
    fast = FastEncoder(tok)
    assert fast.fast
    return tok, fast


ASCII = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=127), max_size=300)
PIECES = st.sampled_from(
    [
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "don't",
        " 123",
        "  \n\n ",
        "\t",
        "I'll",
        "'S",
        "''s",
        "<|im_",
        "x" * 40,
        "Hello",
        "  world",
        "\r\n",
        "\x1c\x1f",
        "!!",
        "a.b,c",
        "1.5e10",
        "<repo_name>x",
        "\x0b\x0c",
    ]
)
MIXED = st.lists(st.one_of(ASCII, PIECES), max_size=12).map("".join)


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=MIXED)
def test_fast_path_equals_tokenizers(encoders, text):
    tok, fast = encoders
    assert fast.encode(text) == tok.encode(text)
    assert fast.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)


# Non-ASCII text where the ASCII-only regex would cut differently from tokenizers' Unicode one:
# letters with diacritics inside ASCII words (\p{L} is one run, [A-Za-z] is not), combining marks,
# non-ASCII digits and spaces, emoji sequences, CJK. Pure random text rarely puts a non-ASCII
# letter next to an ASCII one, so the pieces are mixed on purpose.
UNICODE_PIECES = st.sampled_from(
    [
        "naïve",
        " résumé",
        "café",
        "e\u0301",
        "n\u0303o",
        " Straße",
        "İstanbul",
        "ﬁne",
        " Ωmega",
        "über",
        "👩\u200d👩\u200d👧",
        "🇫🇷",
        " 👍🏽",
        "日本語",
        " 中文",
        "٣٤٥",
        "½",
        "\u00a0",
        "\u2003",
        "\u200b",
        "x\u0300y",
        "Ǆ",
        "ℌ",
        "\u3000",
        "—",
        "’s",
        "'ś",
    ]
)
WORDS = st.sampled_from(
    ["na", "ve", " hello", "world", " 12", "don't", " ", "  ", "\n", "x", ".", "'s"]
)
UNICODE_MIXED = (
    st.lists(st.one_of(UNICODE_PIECES, WORDS, st.text(max_size=6)), min_size=1, max_size=10)
    .map("".join)
    .filter(lambda t: not t.isascii())
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=UNICODE_MIXED)
@example(text="naïve résumé")
@example(text="Straße über café")
def test_non_ascii_falls_back_exactly(encoders, text):
    """Non-ASCII text must take the regular path: the fast path's ASCII regex would cut "naïve" into
    "na" + "ï" + "ve" (3546, 25972, 307) where tokenizers keeps one letter run (3546, 46494)."""
    tok, fast = encoders
    assert fast.encode(text) == tok.encode(text)
    assert fast.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
    assert fast.encode_large(text) == tok.encode(text)


def test_non_ascii_examples_differ_from_an_ascii_split(encoders):
    """The examples above are ones where the fallback matters: the ASCII-regex path gives other ids."""
    tok, fast = encoders
    for text in ("naïve résumé", "Straße über café"):
        ascii_split = []
        fast._encode_ascii(text, ascii_split)
        assert ascii_split != tok.encode(text), text
        assert fast.encode(text) == tok.encode(text)


def test_chat_equals_engine_path(encoders):
    tok, fast = encoders
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What's a KV cache? 42 "},
        {"role": "assistant", "content": "A cache.\n\n  Of keys."},
        {"role": "user", "content": "Héllo ☃"},
    ]
    assert fast.encode_chat(msgs) == tok.encode_chat(msgs)
    assert fast.encode_chat(msgs[:3], add_generation_prompt=False) == tok.encode_chat(
        msgs[:3], False
    )
    # vLLM's continue_final_message: the final message stays open, identically on both paths
    cont = fast.encode_chat(msgs[:3], add_generation_prompt=False, continue_final_message=True)
    assert cont == tok.encode_chat(msgs[:3], False, True)
    closed = tok.encode_chat(msgs[:3], False)
    assert closed[: len(cont)] == cont and len(closed) > len(cont)
    assert tok.render_chat(msgs[:3], False, True).endswith("Of keys.")


def test_chat_template_kwargs_and_bad_combinations(encoders):
    from kvmesh.common.tokenizer import TemplateError

    tok, fast = encoders
    custom = KVMeshTokenizer(find_model_dir("smollm2-135m-instruct"))
    custom.chat_template = (
        "{% for m in messages %}{{ m.content }}{% endfor %}{% if shout %}!!!{% endif %}"
    )
    msgs = [{"role": "user", "content": "hi"}]
    shout = {"shout": True}
    assert (
        custom.render_chat(msgs, template_kwargs=shout) == "hi!!!"
        and custom.render_chat(msgs) == "hi"
    )
    assert FastEncoder(custom).encode_chat(msgs, template_kwargs=shout) == custom.encode_chat(
        msgs, template_kwargs=shout
    )
    with pytest.raises(TemplateError, match="cannot both be true"):
        tok.render_chat(msgs, True, True)
    with pytest.raises(TemplateError, match="may not set messages"):
        tok.render_chat(msgs, template_kwargs={"messages": []})
    with pytest.raises(TemplateError, match="not in the rendered prompt"):
        tok.render_chat([{"role": "assistant", "content": ""}], False, True)
