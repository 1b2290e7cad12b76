"""Every field of every request model, through the three readers of the request surface: the
engine's request models (kvmesh.common.protocol, subclassed by the engine server), the OpenAPI
document derived from them, and the router's admission checks. A valid value passes all three;
an invalid one is refused by the engine (a 400 naming the field) and by the document, and by the
router where the router reads that field (naming the same field)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvmesh.common.openapi import request_schemas
from kvmesh.common.protocol import REQUEST_MODELS
from kvmesh.engine.model_limits import EngineLimits
from kvmesh.engine.sampling_params import InvalidParameter
from kvmesh.engine.server import protocol as engine_protocol
from kvmesh.engine.server.errors import APIError
from kvmesh.engine.server.request_body import decode_body
from kvmesh.router.request_checks import INT_FIELDS, BadRequest, check_request

VOCAB = 100
MODEL = "m"
PATHS = {"CompletionRequest": "/v1/completions", "ChatCompletionRequest": "/v1/chat/completions"}
BASE = {
    "CompletionRequest": {"prompt": "hi"},
    "ChatCompletionRequest": {"messages": [{"role": "user", "content": "hi"}]},
    "TokenizeRequest": {"prompt": "hi"},
    "DetokenizeRequest": {"tokens": [1]},
}
TOOL = {"type": "function", "function": {"name": "f"}}
MESSAGES = [{"role": "user", "content": "hi"}]
NO = "maybe"  # not a boolean, even to pydantic's lax mode

# field -> (a valid value, invalid values); per request model where they differ.
COMMON = {
    "model": (MODEL, [5]),
    "temperature": (0.5, [-1, "hot"]),
    "top_p": (0.5, [0, 1.5]),
    "n": (2, [0, 129, 1.5, "many"]),
    "stream": (True, [NO]),
    "stream_options": ({"include_usage": True}, [5, {"include_usage": NO}]),
    "stop": (["\n"], [[""], "", 5]),
    "seed": (7, [2**64, -(2**63) - 1]),
    "presence_penalty": (1, [3]),
    "frequency_penalty": (-1, [-3]),
    "logit_bias": ({"5": 1}, [{"5": 101}, {"x": 1}]),
    "user": ("u", [5]),
    "top_k": (5, [-2]),
    "min_p": (0.1, [1.5]),
    "repetition_penalty": (1.1, [0]),
    "min_tokens": (1, [-1]),
    "ignore_eos": (True, [NO]),
    "stop_token_ids": ([5], [[-1], 5]),
    "include_stop_str_in_output": (True, [NO]),
    "skip_special_tokens": (False, [NO]),
    "cache_salt": ("s", ["", 5, "s" * 1025]),
    "priority": (0, ["high", 1.5]),
    "prompt_logprobs": (1, [21, -1]),
    "return_token_ids": (True, [NO]),
    "resume": ({"output_token_ids": [1]}, [{"output_token_ids": []}]),
    "response_format": ({"type": "json_object"}, [{"type": "yaml"}]),
    "structured_outputs": ({"regex": "a+"}, [{}]),
    "guided_json": ({"type": "object"}, [5]),
    "guided_regex": ("a+", [5]),
    "guided_choice": (["a"], [[]]),
    "guided_grammar": ('root ::= "a"', [5]),
    "tools": ([], [[TOOL]]),
    "tool_choice": ("none", ["auto"]),
    "functions": ([], [[{"name": "f"}]]),
    "function_call": ("none", ["auto"]),
}
FIELDS = {
    "CompletionRequest": {
        **COMMON,
        "prompt": ([[1, 2], [3]], [5, [], [[]], [-1], ["a"] * 257, [True]]),
        "max_tokens": (5, [-1, 2**63]),
        "logprobs": (1, [21]),
        "echo": (True, [NO]),
        "best_of": (1, [2]),
        "suffix": ("", ["x"]),
    },
    "ChatCompletionRequest": {
        **COMMON,
        "messages": (MESSAGES, [[], [5], "hi"]),
        "tools": ([TOOL], [[{"type": "function", "function": {"name": ""}}], 5]),
        "tool_choice": ("none", ["sometimes"]),
        "parallel_tool_calls": (False, [NO]),
        "max_tokens": (5, [0, 2**63]),
        "max_completion_tokens": (5, [0, -1, 2**63]),
        "logprobs": (True, [NO]),
        "top_logprobs": (2, [21, -1]),
        "add_generation_prompt": (False, [NO]),
        "continue_final_message": (False, [NO]),
        "chat_template_kwargs": ({"a": 1}, [5]),
        "echo": (False, [True]),
    },
    "TokenizeRequest": {
        "model": (MODEL, [5]),
        "prompt": ("hi", [5]),
        "messages": (MESSAGES, [[5], "hi"]),
        "add_special_tokens": (False, [NO]),
        "add_generation_prompt": (False, [NO]),
        "continue_final_message": (False, [NO]),
        "chat_template_kwargs": ({"a": 1}, [5]),
        "tools": ([TOOL], [[{"type": "function", "function": {"name": ""}}]]),
        "tool_choice": ("none", ["sometimes"]),
        "return_token_strs": (True, [NO]),
    },
    "DetokenizeRequest": {
        "model": (MODEL, [5]),
        "tokens": ([1, 2], [[-1], 5, ["a"]]),
    },
}
WITH = {
    ("ChatCompletionRequest", "top_logprobs"): {"logprobs": True}
}  # a field valid only with another


def _body(name: str, field: str, value) -> dict:
    body = {**BASE[name], **WITH.get((name, field), {}), field: value}
    if name == "TokenizeRequest" and field == "messages":
        del body["prompt"]  # exactly one of prompt and messages
    return body


def engine_refusal(name: str, body: dict) -> str | None:
    """The param of the engine's 400 for ``body`` (its request model, what the handler reads from
    it, and the checks against the model's vocabulary), or None when it accepts the body."""
    req, limits = None, EngineLimits(max_model_len=4096, vocab_size=VOCAB)
    try:
        req = decode_body(json.dumps(body).encode(), getattr(engine_protocol, name))
        if name in PATHS:
            req.num_choices()
            req.resume_token_ids()
            limits.validate_params(req.sampling_params())
            if name == "ChatCompletionRequest":
                req.template_messages()
            for prompt in req.prompt_inputs() if name == "CompletionRequest" else ():
                limits.check_token_ids("prompt", prompt if isinstance(prompt, list) else [])
        elif name == "TokenizeRequest":
            req.check()
            req.tool_plan()
            [engine_protocol.template_message(m, i) for i, m in enumerate(req.messages or ())]
    except APIError as exc:
        return exc.param
    except InvalidParameter as exc:
        return req.renamed(exc).param if name in PATHS else exc.param
    return None


def schema_accepts(name: str, body: dict) -> bool:
    schemas = request_schemas(MODEL, VOCAB)
    validator = jsonschema.Draft202012Validator(
        {**schemas[name], "components": {"schemas": schemas}}
    )
    return validator.is_valid(body)


def router_refusal(name: str, body: dict) -> str | None:
    if name not in PATHS:
        return None  # the router passes /tokenize and /detokenize on unread
    try:
        check_request(PATHS[name], body, VOCAB)
    except BadRequest as exc:
        return exc.param
    return None


def router_reads(name: str) -> set[str]:
    path = PATHS.get(name)
    if path is None:
        return set()
    return {
        "cache_salt",
        "messages" if name == "ChatCompletionRequest" else "prompt",
        *INT_FIELDS[path],
    }


def _names(field: str, param: str | None) -> bool:
    return param is not None and (param == field or param.startswith(field + "."))


CASES = [(name, field) for name, fields in FIELDS.items() for field in fields]


def test_every_field_of_every_model_is_walked():
    assert set(FIELDS) == set(REQUEST_MODELS)
    for name, model in REQUEST_MODELS.items():
        assert set(FIELDS[name]) == set(model.model_fields), name
        assert set(getattr(engine_protocol, name).model_fields) == set(model.model_fields), name


@pytest.mark.parametrize("name, field", CASES)
def test_a_valid_value_passes_all_three(name, field):
    body = _body(name, field, FIELDS[name][field][0])
    assert engine_refusal(name, body) is None
    assert schema_accepts(name, body)
    assert router_refusal(name, body) is None


@pytest.mark.parametrize("name, field", CASES)
def test_an_invalid_value_is_refused_naming_the_field(name, field):
    for value in FIELDS[name][field][1]:
        body = _body(name, field, value)
        param = engine_refusal(name, body)
        assert _names(field, param), (value, param)
        assert not schema_accepts(name, body), value
        param = router_refusal(name, body)
        if field in router_reads(name):
            assert _names(field, param), (value, param)
        else:
            assert param is None, (value, param)  # the engine's to refuse


def test_the_router_reads_the_models_bounds():
    assert INT_FIELDS["/v1/completions"] == {"n": (1, 128), "max_tokens": (0, 2**63 - 1)}
    assert INT_FIELDS["/v1/chat/completions"] == {
        "n": (1, 128),
        "max_tokens": (1, 2**63 - 1),
        "max_completion_tokens": (1, 2**63 - 1),
    }


def test_max_completion_tokens_is_chat_only():
    """As vLLM's: ChatCompletionRequest has max_completion_tokens (overriding max_tokens),
    CompletionRequest has none (an unknown field, ignored)."""
    assert "max_completion_tokens" not in REQUEST_MODELS["CompletionRequest"].model_fields
    assert "max_completion_tokens" not in request_schemas()["CompletionRequest"]["properties"]
    body = {"prompt": "hi", "max_tokens": 3, "max_completion_tokens": 9}
    req = decode_body(json.dumps(body).encode(), engine_protocol.CompletionRequest)
    assert req.sampling_params().max_tokens == 3
    chat = {"messages": MESSAGES, "max_tokens": 3, "max_completion_tokens": 9}
    req = decode_body(json.dumps(chat).encode(), engine_protocol.ChatCompletionRequest)
    assert req.sampling_params().max_tokens == 9
