"""Every form of ``tools``, ``tool_choice`` and ``parallel_tool_calls``, planned without a server: the
mode, the exact constraint schema, the exact number of calls each parser keeps, the exact error
(param) of a bad form, and whether the chat template is told about the tools."""

from __future__ import annotations

import json

import pytest

from kvmesh.common.chat_prompt import HermesPrompt, describes_tools, tool_template_inputs
from kvmesh.engine.sampling_params import InvalidParameter
from kvmesh.engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
)
from kvmesh.engine.server.serving_chat import ChatHandler
from kvmesh.engine.server.tool_choice import (
    AUTO_NEEDS_FLAGS,
    NO_ARGUMENTS,
    ToolPlan,
    auto_parser,
    plan_tools,
)
from kvmesh.engine.server.tool_parsers.forced import NamedFunctionParser, RequiredCallsParser
from kvmesh.engine.server.tool_parsers.hermes import HermesToolParser
from kvmesh.engine.server.tool_parsers.llama3_json import Llama3JsonToolParser
from kvmesh.engine.server.tool_prompt import template_inputs

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
CLOCK = {"type": "function", "function": {"name": "now"}}  # no parameters
TOOLS = [WEATHER, CLOCK]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]

ITEMS = [
    {
        "properties": {
            "name": {"type": "string", "enum": ["get_weather"]},
            "parameters": CITY,
        },
        "required": ["name", "parameters"],
    },
    {
        "properties": {"name": {"type": "string", "enum": ["now"]}, "parameters": NO_ARGUMENTS},
        "required": ["name", "parameters"],
    },
]
ANY_NUMBER = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": ITEMS}}
ONE_CALL = {**ANY_NUMBER, "maxItems": 1}


# -- the mode ---------------------------------------------------------------------------------------
# (tools, tool_choice, parallel_tool_calls) -> (mode, function name, parallel), or None: no tools
PLANS = [
    (None, None, None, None),
    ([], None, None, None),
    (None, "none", None, None),
    ([], "none", None, None),
    ([], "required", None, None),  # OpenAI's: required with no tools is none
    (None, "required", False, None),
    (TOOLS, "none", None, ("none", None, True)),
    (TOOLS, "none", False, ("none", None, True)),
    (TOOLS, None, None, ("auto", None, True)),
    (TOOLS, None, True, ("auto", None, True)),
    (TOOLS, None, False, ("auto", None, False)),
    (TOOLS, "auto", None, ("auto", None, True)),
    (TOOLS, "auto", True, ("auto", None, True)),
    (TOOLS, "auto", False, ("auto", None, False)),
    (TOOLS, "required", None, ("required", None, True)),
    (TOOLS, "required", True, ("required", None, True)),
    (TOOLS, "required", False, ("required", None, False)),
    (TOOLS, NAMED, None, ("named", "get_weather", True)),
    (TOOLS, NAMED, True, ("named", "get_weather", True)),
    (TOOLS, NAMED, False, ("named", "get_weather", False)),
    (TOOLS, {"function": {"name": "now"}}, None, ("named", "now", True)),  # type defaults
]


@pytest.mark.parametrize("tools, choice, parallel, want", PLANS)
def test_each_form_plans_its_mode(tools, choice, parallel, want):
    plan = plan_tools(tools, choice, parallel)
    if want is None:
        assert plan is None
        return
    assert (plan.mode, plan.function_name, plan.parallel) == want
    assert plan.tools == TOOLS


# (tools, tool_choice) -> the param a 400 names, and a piece of its message
BAD = [
    (TOOLS, "sometimes", "tool_choice", "Invalid value for `tool_choice`"),
    (TOOLS, "NONE", "tool_choice", "Invalid value for `tool_choice`"),
    (TOOLS, "", "tool_choice", "Invalid value for `tool_choice`"),
    (TOOLS, 3, "tool_choice", "a named function"),
    (TOOLS, ["auto"], "tool_choice", "a named function"),
    (TOOLS, True, "tool_choice", "a named function"),
    (None, "auto", "tool_choice", "`tools` must be set"),
    ([], "auto", "tool_choice", "`tools` must be set"),
    (None, NAMED, "tool_choice", "`tools` must be set"),
    ([], NAMED, "tool_choice", "`tools` must be set"),
    (TOOLS, {"type": "function"}, "tool_choice.function", "Invalid value for `function`"),
    (TOOLS, {"type": "function", "function": "now"}, "tool_choice.function", "`function`"),
    (TOOLS, {"type": "function", "function": {}}, "tool_choice.function.name", "Expected"),
    (TOOLS, {"function": {"name": ""}}, "tool_choice.function.name", "Expected"),
    (TOOLS, {"function": {"name": 3}}, "tool_choice.function.name", "Expected"),
    (TOOLS, {"type": "retrieval", "function": {"name": "now"}}, "tool_choice.type", "function"),
    (
        TOOLS,
        {"type": "function", "function": {"name": "nope"}},
        "tool_choice.function.name",
        "'nope'",
    ),
    (
        TOOLS,
        {"type": "function", "function": {"name": "Now"}},
        "tool_choice.function.name",
        "'Now'",
    ),
]


@pytest.mark.parametrize("tools, choice, param, message", BAD)
@pytest.mark.parametrize("parallel", [None, False])
def test_each_bad_form_names_its_field(tools, choice, param, message, parallel):
    with pytest.raises(InvalidParameter) as err:
        plan_tools(tools, choice, parallel)
    assert err.value.param == param
    assert message in str(err.value)


# -- the constraint ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "choice, parallel, want",
    [
        ("none", None, None),
        ("none", False, None),
        ("auto", None, None),
        ("auto", False, None),
        (None, False, None),
        ("required", None, ANY_NUMBER),
        ("required", True, ANY_NUMBER),
        ("required", False, ONE_CALL),
        (NAMED, None, CITY),
        (NAMED, False, CITY),
        ({"type": "function", "function": {"name": "now"}}, None, NO_ARGUMENTS),
    ],
)
def test_the_exact_schema_each_form_constrains_the_output_to(choice, parallel, want):
    plan = plan_tools(TOOLS, choice, parallel)
    assert plan.schema() == want
    params = ChatCompletionRequest.model_validate(
        {"messages": ASK, "tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": parallel}
    ).sampling_params()
    if want is None:
        assert params.structured_outputs is None
    else:
        assert params.structured_outputs.json == want
        assert params.structured_outputs.field_name == "tools"  # a compile error names `tools`


def test_one_tool_required_is_a_one_item_anyof():
    schema = plan_tools([CLOCK], "required", None).schema()
    assert schema == {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": ITEMS[1:]},
    }


def test_tools_that_define_one_def_twice_differently_are_refused():
    def tool(name, def_type):
        params = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}}
        return {
            "type": "function",
            "function": {
                "name": name,
                "parameters": {**params, "$defs": {"P": {"type": def_type}}},
            },
        }

    same = plan_tools([tool("a", "integer"), tool("b", "integer")], "required", False).schema()
    assert same["$defs"] == {"P": {"type": "integer"}} and same["maxItems"] == 1
    with pytest.raises(InvalidParameter) as err:
        plan_tools([tool("a", "integer"), tool("b", "string")], "required", None).schema()
    assert err.value.param == "tools"


def test_schema_leaves_the_plans_tools_as_they_were():
    tools = json.loads(json.dumps(TOOLS))
    plan_tools(tools, "required", False).schema()
    assert tools == TOOLS


@pytest.mark.parametrize(
    "extra",
    [{"structured_outputs": {"choice": ["a"]}}, {"response_format": {"type": "json_object"}}],
)
@pytest.mark.parametrize("choice", ["required", NAMED])
def test_a_constraining_choice_refuses_another_constraint(choice, extra):
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": choice, **extra}
    with pytest.raises(InvalidParameter) as err:
        ChatCompletionRequest.model_validate(body).sampling_params()
    assert err.value.param == "tool_choice"


@pytest.mark.parametrize("choice", [None, "auto", "none"])
def test_a_free_choice_keeps_the_requests_own_constraint(choice):
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": choice}
    params = ChatCompletionRequest.model_validate(
        {**body, "structured_outputs": {"choice": ["a"]}}
    ).sampling_params()
    assert list(params.structured_outputs.choice) == ["a"]


# -- how many calls the output is read as -------------------------------------------------------------
REQUIRED_TWO = (
    '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "now", "parameters": {}}]'
)
HERMES_TWO = (
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
    '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
)
LLAMA_TWO = (
    '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "now", "parameters": {}}'
)


@pytest.mark.parametrize(
    "choice, server_parser, output, kind",
    [
        ("required", None, REQUIRED_TWO, RequiredCallsParser),
        ("required", HermesToolParser, REQUIRED_TWO, RequiredCallsParser),
        ("auto", HermesToolParser, HERMES_TWO, HermesToolParser),
        (None, HermesToolParser, HERMES_TWO, HermesToolParser),
        ("auto", Llama3JsonToolParser, LLAMA_TWO, Llama3JsonToolParser),
    ],
)
@pytest.mark.parametrize("parallel, calls", [(None, 2), (True, 2), (False, 1)])
def test_parallel_tool_calls_sets_the_exact_number_of_calls(
    choice, server_parser, output, kind, parallel, calls
):
    plan = plan_tools(TOOLS, choice, parallel)
    parser = plan.parser(server_parser)
    assert type(parser) is kind and parser.limit == (1 if calls == 1 else None)
    assert [c.name for c in parser.parse(output).tool_calls] == ["get_weather", "now"][:calls]
    streamed = plan.parser(server_parser)
    deltas = [streamed.feed(ch) for ch in output] + [streamed.finish()]
    named = [d.name for delta in deltas for d in delta.calls if d.id is not None]
    assert named == ["get_weather", "now"][:calls] and streamed.num_calls == calls


@pytest.mark.parametrize("parallel", [None, True, False])
def test_a_named_function_is_one_call_of_it(parallel):
    parser = plan_tools(TOOLS, NAMED, parallel).parser(HermesToolParser)
    assert type(parser) is NamedFunctionParser and parser.limit == 1
    out = parser.parse('{"city": "Oslo"}')
    assert out.content == "" and [(c.name, c.arguments) for c in out.tool_calls] == [
        ("get_weather", '{"city": "Oslo"}')
    ]
    assert not parser.finishes_with_tool_calls


@pytest.mark.parametrize("server_parser", [None, HermesToolParser])
def test_none_and_auto_without_a_parser_read_plain_content(server_parser):
    assert plan_tools(TOOLS, "none", None).parser(server_parser) is None
    assert plan_tools(TOOLS, "auto", None).parser(None) is None


# -- the server's flags -----------------------------------------------------------------------------
@pytest.mark.parametrize("choice", [None, "auto"])
@pytest.mark.parametrize("enable, name", [(False, None), (False, "hermes"), (True, None)])
def test_auto_without_the_servers_flags_is_refused(choice, enable, name):
    with pytest.raises(InvalidParameter) as err:
        auto_parser(plan_tools(TOOLS, choice, None), enable, name)
    assert err.value.param == "tool_choice" and str(err.value) == AUTO_NEEDS_FLAGS


@pytest.mark.parametrize(
    "name, kind", [("hermes", HermesToolParser), ("llama3_json", Llama3JsonToolParser)]
)
def test_auto_with_the_flags_reads_with_the_servers_parser(name, kind):
    assert auto_parser(plan_tools(TOOLS, "auto", None), True, name) is kind
    assert auto_parser(plan_tools(TOOLS, None, False), True, name) is kind


@pytest.mark.parametrize("choice", ["none", "required", NAMED])
@pytest.mark.parametrize("enable, name", [(False, None), (True, "hermes")])
def test_other_modes_need_no_flags_and_no_auto_parser(choice, enable, name):
    assert auto_parser(plan_tools(TOOLS, choice, None), enable, name) is None
    assert auto_parser(None, enable, name) is None


# -- finish_reason ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "parser, finish, called, want",
    [
        (RequiredCallsParser(), "stop", True, "tool_calls"),
        (RequiredCallsParser(), "stop", False, "stop"),
        (RequiredCallsParser(), "length", True, "length"),
        (HermesToolParser(), "stop", True, "tool_calls"),
        (HermesToolParser(), "stop", False, "stop"),
        (HermesToolParser(), None, True, None),
        (NamedFunctionParser("f"), "stop", True, "stop"),
        (NamedFunctionParser("f"), "length", True, "length"),
    ],
)
def test_finish_reason_after_calls(parser, finish, called, want):
    assert ChatHandler.tool_finish(parser, finish, called) == want


# -- the template -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "tools, choice, want",
    [
        (TOOLS, None, True),
        (TOOLS, "auto", True),
        (TOOLS, "required", True),
        (TOOLS, NAMED, True),
        (TOOLS, "none", False),
        ([], None, False),
        (None, "required", False),
    ],
)
def test_which_requests_describe_the_tools_to_a_template_without_tool_support(tools, choice, want):
    """The router's reading (describes_tools) and the engine's (the plan) agree, and the default
    prompt is added exactly then."""
    assert describes_tools(tools, choice) is want
    plan = plan_tools(tools, choice, None)
    assert (plan is not None and plan.mode != "none") is want
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    messages, tool_vars = tool_template_inputs(template, ASK, tools, want)
    assert (messages, tool_vars) == template_inputs(template, ASK, plan, None)
    assert tool_vars == {}
    if want:
        assert messages == [{"role": "system", "content": HermesPrompt.default_prompt(TOOLS)}, *ASK]
    else:
        assert messages == ASK


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": TOOLS}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": NAMED}, "tool_choice"),
    ],
)
def test_completions_refuse_tools(fields, param):
    with pytest.raises(InvalidParameter) as err:
        CompletionRequest.model_validate({"prompt": "x", **fields}).sampling_params()
    assert err.value.param == param


def test_completions_take_tool_choice_none():
    assert CompletionRequest.model_validate(
        {"prompt": "x", "tool_choice": "none"}
    ).sampling_params()


def test_tokenize_plans_parallel_calls_as_the_default():
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required"}
    assert TokenizeRequest.model_validate(body).tool_plan() == ToolPlan("required", TOOLS)


@pytest.mark.parametrize(
    "tool, param",
    [
        ({"type": "function", "function": {"name": ""}}, "tools.0.function.name"),
        ({"type": "function", "function": {}}, "tools.0.function.name"),
        ({"type": "function"}, "tools.0.function"),
        ({"type": "retrieval", "function": {"name": "f"}}, "tools.0.type"),
    ],
)
def test_a_bad_tool_names_its_own_field(tool, param):
    """A bound of a tool's own field (a name of at least one character) is no bound of the request."""
    from pydantic import ValidationError

    from kvmesh.engine.server.protocol import first_error_param

    for cls in (ChatCompletionRequest, TokenizeRequest):
        with pytest.raises(ValidationError) as err:
            cls.model_validate({"messages": ASK, "tools": [tool]})
        assert first_error_param(err.value, cls)[0] == param
