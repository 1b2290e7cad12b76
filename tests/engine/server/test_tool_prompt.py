"""Tools in the chat template: a template that reads ``tools`` gets them (and decoded call arguments);
one that does not (the built-in SmolLM2's) gets the documented default prompt and history."""

from __future__ import annotations

import json

import pytest

from kvmesh.common.tokenizer import KVMeshTokenizer
from kvmesh.engine.server.protocol import ChatCompletionRequest
from kvmesh.engine.server.tool_parsers.llama3_json import Llama3JsonToolParser
from kvmesh.engine.server.tool_prompt import template_inputs, template_reads_tools

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CONVERSATION = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call-1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call-1", "content": "-3 C, snow"},
]
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m.role }}: "
    "{{ m.content }}{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} "
    "{{ c.function.arguments.city }}{% endfor %}{% endif %}\n{% endfor %}"
)


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": CONVERSATION, "tools": [TOOL], **fields}
    )


@pytest.fixture(scope="module")
def smollm_tokenizer(tiny_model):
    return KVMeshTokenizer(tiny_model)


def render(tokenizer, req: ChatCompletionRequest, parser=None) -> str:
    messages, tool_vars = template_inputs(
        tokenizer.chat_template, req.template_messages(), req.tool_plan(), parser
    )
    return tokenizer.render_chat(messages, True, False, tool_vars)


def test_a_template_that_reads_tools_gets_them_and_decoded_arguments(smollm_tokenizer):
    assert template_reads_tools(TOOL_TEMPLATE) and not template_reads_tools(
        smollm_tokenizer.chat_template
    )
    req = request(tool_choice="required")
    messages, tool_vars = template_inputs(
        TOOL_TEMPLATE, req.template_messages(), req.tool_plan(), None
    )
    assert tool_vars == {"tools": [TOOL]}
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    smollm_tokenizer.chat_template, saved = TOOL_TEMPLATE, smollm_tokenizer.chat_template
    smollm_tokenizer._template = None
    try:
        text = smollm_tokenizer.render_chat(messages, False, False, tool_vars)
    finally:
        smollm_tokenizer.chat_template, smollm_tokenizer._template = saved, None
    assert text.startswith("TOOLS:" + json.dumps([TOOL])) and "CALL get_weather Oslo" in text


def test_a_template_without_tool_support_gets_the_default_prompt_and_history(smollm_tokenizer):
    text = render(smollm_tokenizer, request(tool_choice="required"))
    assert text.startswith("<|im_start|>system\n# Tools") and json.dumps(TOOL) in text
    assert (
        "<|im_start|>assistant\n<tool_call>\n"
        + json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}})
        in text
    )
    assert "<|im_start|>user\n<tool_response>\n-3 C, snow\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_the_default_prompt_joins_an_existing_system_message(smollm_tokenizer):
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "system", "content": "Be brief."}] + CONVERSATION,
            "tools": [TOOL],
            "tool_choice": "required",
        }
    )
    text = render(smollm_tokenizer, req)
    assert (
        text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
        and text.count("<|im_start|>system") == 1
    )


def test_the_parsers_format_is_the_default_prompts(smollm_tokenizer):
    text = render(smollm_tokenizer, request(tool_choice="auto"), Llama3JsonToolParser)
    assert '"parameters": dictionary of argument name' in text
    assert json.dumps({"name": "get_weather", "parameters": {"city": "Oslo"}}) in text


def test_tool_choice_none_adds_no_tool_prompt_but_keeps_the_history(smollm_tokenizer):
    text = render(smollm_tokenizer, request(tool_choice="none"))
    assert "# Tools" not in text and "<tool_response>" in text


def test_required_schema_is_an_array_of_the_tools_calls():
    plan = ChatCompletionRequest.model_validate(
        {
            "messages": CONVERSATION,
            "tools": [TOOL, {"type": "function", "function": {"name": "now"}}],
            "tool_choice": "required",
            "parallel_tool_calls": False,
        }
    ).tool_plan()
    schema = plan.schema()
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["now"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {
        "type": "object",
        "properties": {},
    }


def test_defs_of_the_tools_move_to_the_arrays_top():
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {"p": {"$ref": "#/$defs/P"}},
                "$defs": {"P": {"type": "integer"}},
            },
        },
    }
    req = ChatCompletionRequest.model_validate(
        {"messages": CONVERSATION, "tools": [tool], "tool_choice": "required"}
    )
    schema = req.tool_plan().schema()
    assert schema["$defs"] == {"P": {"type": "integer"}}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert "$defs" in req.tools[0].function.parameters, "the request's own tools are left as sent"


def test_a_named_function_schema_is_its_parameters():
    req = request(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert req.tool_plan().schema() == TOOL["function"]["parameters"]
    assert req.sampling_params().structured_outputs.json == TOOL["function"]["parameters"]
