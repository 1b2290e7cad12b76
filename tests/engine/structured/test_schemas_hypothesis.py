"""Hypothesis-generated JSON schemas from a bounded grammar of schema features (objects with required
and optional properties, nested objects, arrays with item bounds, strings with length bounds and
patterns, bounded integers, booleans, enums, const, anyOf, null): every schema compiles, and
decoding random logits under its mask, greedy and sampled, yields JSON that validates."""

import json

import jsonschema
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.engine.structured.compiler import GrammarCache
from kvmesh.engine.structured.params import StructuredOutputsParams as SOP
from tests.engine.structured.test_grammar import _generate

NAMES = st.sampled_from(["id", "name", "tags", "score", "ok", "kind", "child", "note"])
WORDS = st.text(alphabet="abcxyz", min_size=1, max_size=4)


def _string():
    return st.one_of(
        st.builds(
            lambda lo, extra: {"type": "string", "minLength": lo, "maxLength": lo + extra},
            st.integers(0, 2),
            st.integers(0, 5),
        ),
        st.just({"type": "string", "pattern": "^[a-c]{1,4}$"}),
    )


def _integer():
    return st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-50, 50),
        st.integers(0, 200),
    )


def _leaf():
    return st.one_of(
        _string(),
        _integer(),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.lists(WORDS, min_size=1, max_size=3, unique=True).map(lambda v: {"enum": v}),
        WORDS.map(lambda v: {"const": v}),
    )


def _object(children):
    def build(props, required_mask):
        required = [k for k, keep in zip(props, required_mask) if keep]
        schema = {"type": "object", "properties": props, "additionalProperties": False}
        if required:
            schema["required"] = required
        return schema

    return st.dictionaries(NAMES, children, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.booleans(), min_size=len(props), max_size=len(props)).map(
            lambda mask: build(props, mask)
        )
    )


def _array(children):
    return st.builds(
        lambda items, lo, extra: {
            "type": "array",
            "items": items,
            "minItems": lo,
            "maxItems": lo + extra,
        },
        children,
        st.integers(0, 1),
        st.integers(0, 2),
    )


SCHEMAS = _object(
    st.recursive(
        _leaf(),
        lambda children: st.one_of(
            _object(children),
            _array(children),
            st.lists(children, min_size=2, max_size=2).map(lambda v: {"anyOf": v}),
        ),
        max_leaves=6,
    )
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=SCHEMAS, seed=st.integers(0, 2**16), greedy=st.booleans())
def test_generated_schemas_decode_to_valid_json(tokenizer, tokenizer_info, schema, seed, greedy):
    cache = _cache(tokenizer_info)
    text = _generate(cache, tokenizer, SOP(json=schema), seed, greedy, max_tokens=400)
    jsonschema.validate(json.loads(text), schema)


_caches: dict[int, GrammarCache] = {}


def _cache(tokenizer_info) -> GrammarCache:
    return _caches.setdefault(id(tokenizer_info), GrammarCache(tokenizer_info))
