import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.common.models import resolve_model_dir
from kvmesh.common.tokenizer import KVMeshTokenizer
from kvmesh.router.fast_tokenize import FastEncoder


@pytest.fixture(scope="module")
def encoders():
    tok = KVMeshTokenizer(resolve_model_dir("smollm2-135m-instruct", convert=False))
    fast = FastEncoder(tok)
    assert fast.fast
    return tok, fast


ASCII = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=127), max_size=300)
PIECES = st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "don't", " 123", "  \n\n ", "\t",
                          "I'll", "'S", "''s", "<|im_", "x" * 40, "Hello", "  world", "\r\n", "\x1c\x1f",
                          "!!", "a.b,c", "1.5e10", "<repo_name>x", "\x0b\x0c"])
MIXED = st.lists(st.one_of(ASCII, PIECES), max_size=12).map("".join)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=MIXED)
def test_fast_path_equals_tokenizers(encoders, text):
    tok, fast = encoders
    assert fast.encode(text) == tok.encode(text)
    assert fast.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=80))
def test_non_ascii_falls_back_exactly(encoders, text):
    tok, fast = encoders
    assert fast.encode(text) == tok.encode(text)


def test_chat_equals_engine_path(encoders):
    tok, fast = encoders
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What's a KV cache? 42 "},
            {"role": "assistant", "content": "A cache.\n\n  Of keys."}, {"role": "user", "content": "Héllo ☃"}]
    assert fast.encode_chat(msgs) == tok.encode_chat(msgs)
    assert fast.encode_chat(msgs[:3], add_generation_prompt=False) == tok.encode_chat(msgs[:3], False)
    # vLLM's continue_final_message: the final message stays open, identically on both paths
    cont = fast.encode_chat(msgs[:3], add_generation_prompt=False, continue_final_message=True)
    assert cont == tok.encode_chat(msgs[:3], False, True)
    closed = tok.encode_chat(msgs[:3], False)
    assert closed[:len(cont)] == cont and len(closed) > len(cont)
    assert tok.render_chat(msgs[:3], False, True).endswith("Of keys.")


def test_chat_template_kwargs_and_bad_combinations(encoders):
    from kvmesh.common.tokenizer import TemplateError

    tok, fast = encoders
    custom = KVMeshTokenizer(resolve_model_dir("smollm2-135m-instruct", convert=False))
    custom.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}{% if shout %}!!!{% endif %}"
    msgs = [{"role": "user", "content": "hi"}]
    shout = {"shout": True}
    assert custom.render_chat(msgs, template_kwargs=shout) == "hi!!!" and custom.render_chat(msgs) == "hi"
    assert FastEncoder(custom).encode_chat(msgs, template_kwargs=shout) == custom.encode_chat(msgs,
                                                                                           template_kwargs=shout)
    with pytest.raises(TemplateError, match="cannot both be true"):
        tok.render_chat(msgs, True, True)
    with pytest.raises(TemplateError, match="may not set messages"):
        tok.render_chat(msgs, template_kwargs={"messages": []})
    with pytest.raises(TemplateError, match="not in the rendered prompt"):
        tok.render_chat([{"role": "assistant", "content": ""}], False, True)
