"""tool_choice: the exact 400 messages and the schema's independence from the request's tools,
which test_tool_plan.py left free (docs/mutation.md)."""

from __future__ import annotations

import pytest

from kvmesh.engine.sampling_params import InvalidParameter
from kvmesh.engine.server.tool_choice import NAMED_USAGE, plan_tools

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
NO_TOOLS = "When using `tool_choice`, `tools` must be set."


def refusal(tools, choice) -> tuple[str, str]:
    with pytest.raises(InvalidParameter) as err:
        plan_tools(tools, choice, None)
    return err.value.param, str(err.value)


@pytest.mark.parametrize(
    "tools, choice, param, message",
    [
        (
            TOOLS,
            "sometimes",
            "tool_choice",
            "Invalid value for `tool_choice`: 'sometimes'! Only "
            'named tools, "none", "auto" or "required" are supported.',
        ),
        ([], "auto", "tool_choice", NO_TOOLS),
        (None, {"function": {"name": "get_weather"}}, "tool_choice", NO_TOOLS),
        (
            TOOLS,
            {"type": "code", "function": {"name": "get_weather"}},
            "tool_choice.type",
            'tool_choice.type must be "function"',
        ),
        (
            TOOLS,
            {"function": {"name": "nope"}},
            "tool_choice.function.name",
            "tool_choice names the function 'nope', which is not among `tools`",
        ),
        (
            TOOLS,
            3,
            "tool_choice",
            f'tool_choice must be "none", "auto", "required" or a named function. {NAMED_USAGE}',
        ),
    ],
)
def test_each_refusal_says_exactly_what_is_wrong(tools, choice, param, message):
    assert refusal(tools, choice) == (param, message)


def test_a_long_value_is_quoted_up_to_its_first_40_characters():
    _, message = refusal(TOOLS, "x" * 100)
    assert f"`tool_choice`: {'x' * 40!r}!" in message


def test_a_long_unknown_function_name_is_quoted_up_to_64_characters():
    _, message = refusal(TOOLS, {"function": {"name": "f" * 100}})
    assert f"function {'f' * 64!r}, which" in message


def test_two_different_defs_of_one_name_are_named_in_the_refusal():
    def tool(name, def_type):
        params = {"type": "object", "$defs": {"P": {"type": def_type}}}
        return {"type": "function", "function": {"name": name, "parameters": params}}

    with pytest.raises(InvalidParameter) as err:
        plan_tools([tool("a", "integer"), tool("b", "string")], "required", None).schema()
    assert str(err.value) == "tools define $defs 'P' twice, with different schemas"


def test_the_required_schema_shares_no_object_with_the_tools():
    # the schema goes on to the grammar compiler: editing it must never reach the request's tools
    schema = plan_tools(TOOLS, "required", None).schema()
    params = schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert params == CITY
    params["properties"]["city"]["type"] = "integer"
    assert CITY["properties"]["city"] == {"type": "string"}
