"""Constrained-decoding backends side by side: grammar compile time (cold: a fresh compiler with no
cache; cached: the same spec again) and next-token mask time per token while a valid document walks
through the matcher. Each backend that imports is measured; one that does not is reported as absent.

    python -P bench/structured_backends.py [--model smollm2-135m-instruct] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import time

SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "kind": {"enum": ["a", "b", "c"]},
                },
                "required": ["id"],
            },
            "score": {"type": "number", "minimum": 0},
        },
        "required": ["user"],
    },
    "anyof_ref": {
        "type": "object",
        "properties": {
            "v": {
                "anyOf": [
                    {"type": "string", "pattern": "^[a-z]+$"},
                    {"type": "integer"},
                    {"type": "null"},
                ]
            },
            "items": {
                "type": "array",
                "items": {"$ref": "#/$defs/it"},
                "minItems": 1,
                "maxItems": 4,
            },
        },
        "required": ["v"],
        "$defs": {
            "it": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
        },
    },
}
# A document valid under SCHEMAS["nested"]: the mask-time walk.
WALK_SCHEMA = "nested"
WALK_DOC = json.dumps(
    {"user": {"id": 12345, "tags": ["alpha", "beta gamma", "delta"], "kind": "b"}, "score": 3.25}
)


def _ms(fn):
    start = time.perf_counter()
    result = fn()
    return (time.perf_counter() - start) * 1e3, result


def _pct(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _line(backend, what, values):
    print(
        f"{backend:10s} {what:28s} p50 {_pct(values, 0.5):8.3f} ms  p99 {_pct(values, 0.99):8.3f} ms"
    )


def bench_xgrammar(tok, repeats):
    import xgrammar as xgr

    ms, info = _ms(lambda: xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok)))
    print(f"xgrammar   tokenizer info {ms:.1f} ms (once per engine)")
    for name, schema in SCHEMAS.items():
        spec = json.dumps(schema)
        cold = [
            _ms(
                lambda: xgr.GrammarCompiler(
                    info, max_threads=1, cache_enabled=False
                ).compile_json_schema(spec)
            )[0]
            for _ in range(repeats)
        ]
        cached_compiler = xgr.GrammarCompiler(info, max_threads=1)
        cached_compiler.compile_json_schema(spec)
        cached = [_ms(lambda: cached_compiler.compile_json_schema(spec))[0] for _ in range(repeats)]
        _line("xgrammar", f"compile {name} cold", cold)
        _line("xgrammar", f"compile {name} cached", cached)
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(
        json.dumps(SCHEMAS[WALK_SCHEMA])
    )
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    times = []
    for token in tok.encode(WALK_DOC, add_special_tokens=False):
        times.append(_ms(lambda: matcher.fill_next_token_bitmask(bitmask))[0])
        assert matcher.accept_token(token)
    _line("xgrammar", f"mask per token ({len(times)} tok)", times)


def bench_llguidance(tok, repeats):
    import llguidance.hf
    from llguidance import LLMatcher
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

    ms, lltok = _ms(lambda: llguidance.hf.from_tokenizer(tok))
    print(f"llguidance tokenizer info {ms:.1f} ms (once per engine)")
    for name, schema in SCHEMAS.items():
        grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema))
        # llguidance compiles lazily inside the matcher and keeps no cross-matcher cache: cold only.
        cold = [_ms(lambda: LLMatcher(lltok, grammar, log_level=1))[0] for _ in range(repeats)]
        _line("llguidance", f"compile {name} cold", cold)
    matcher = LLMatcher(
        lltok, LLMatcher.grammar_from_json_schema(json.dumps(SCHEMAS[WALK_SCHEMA])), log_level=1
    )
    bitmask = allocate_token_bitmask(1, lltok.vocab_size)
    times = []
    for token in tok.encode(WALK_DOC, add_special_tokens=False):
        times.append(_ms(lambda: fill_next_token_bitmask(matcher, bitmask, 0))[0])
        assert matcher.consume_token(token), matcher.get_error()
    _line("llguidance", f"mask per token ({len(times)} tok)", times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="built-in model name or model dir (tokenizer)",
    )
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from kvmesh.engine.builtin import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir(args.model)))
    for name, bench in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
        try:
            bench(tok, args.repeats)
        except ImportError as exc:
            print(f"{name:10s} absent ({exc})")


if __name__ == "__main__":
    main()
