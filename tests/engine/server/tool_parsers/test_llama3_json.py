"""The Llama 3 JSON parser: whole outputs, and streams split at every character boundary."""

from __future__ import annotations

import json

import pytest

from kvmesh.engine.server.tool_parsers.llama3_json import Llama3JsonToolParser
from tests.engine.server.tool_parsers.streaming import check_stream_matches_whole

ONE = '{"name": "get_weather", "parameters": {"city": "San Francisco, CA", "unit": "fahrenheit"}}'
TWO = ONE + '; {"name": "search", "parameters": {"q": "{not a brace} \\\\ ok", "n": 3}}'


def test_one_call():
    out = Llama3JsonToolParser().parse(ONE)
    assert out.content is None
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("get_weather", {"city": "San Francisco, CA", "unit": "fahrenheit"})
    ]


def test_calls_separated_by_semicolons_and_the_python_tag():
    out = Llama3JsonToolParser().parse("<|python_tag|>" + TWO)
    assert [c.name for c in out.tool_calls] == ["get_weather", "search"]
    assert json.loads(out.tool_calls[1].arguments) == {"q": "{not a brace} \\ ok", "n": 3}


def test_arguments_is_accepted_as_well_as_parameters():
    out = Llama3JsonToolParser().parse('{"name": "f", "arguments": {"a": true}}')
    assert out.tool_calls[0].arguments == '{"a": true}'


@pytest.mark.parametrize("text", ["The weather is fine.", 'Here: {"name": "f"}', "<|python", ""])
def test_an_output_that_does_not_start_with_a_call_is_content(text):
    out = Llama3JsonToolParser().parse(text)
    assert out.content == text and out.tool_calls == []


@pytest.mark.parametrize(
    "text",
    ['{"name": "f", "parameters": {"a": 1}', '{"name": "f"} trailing words', '{"parameters": {}}'],
)
def test_calls_that_do_not_parse_leave_the_output_as_content(text):
    out = Llama3JsonToolParser().parse(text)
    assert out.content == text and out.tool_calls == []


@pytest.mark.parametrize("text", [ONE, TWO, "  <|python_tag|>" + ONE, "Just text.", "<|python_ta"])
def test_a_stream_split_anywhere_adds_up_to_the_whole_response(text):
    check_stream_matches_whole(Llama3JsonToolParser, text)
