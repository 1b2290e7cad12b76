"""Outputs forced by tool_choice required (an array of calls) or a named function (its arguments)."""

from __future__ import annotations

import json

from kvmesh.engine.server.tool_parsers.forced import NamedFunctionParser, RequiredCallsParser
from tests.engine.server.tool_parsers.streaming import check_stream_matches_whole, replay

ARRAY = (
    '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "now", "parameters": {}}]'
)


def test_required_reads_every_item_of_the_array():
    out = RequiredCallsParser().parse(ARRAY)
    assert out.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("now", {}),
    ]


def test_required_stream_split_anywhere_adds_up_to_the_whole_response():
    check_stream_matches_whole(RequiredCallsParser, ARRAY)


def test_required_with_parallel_calls_off_keeps_one_call():
    assert [c.name for c in RequiredCallsParser(limit=1).parse(ARRAY).tool_calls] == ["get_weather"]


def test_named_function_output_is_its_arguments():
    out = NamedFunctionParser("get_weather").parse('{"city": "Oslo"}')
    assert out.content == ""
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("get_weather", '{"city": "Oslo"}')]


def test_named_function_stream_names_the_call_once():
    text = '{"city": "Oslo"}'
    content, calls = replay(lambda: NamedFunctionParser("get_weather"), ["", *text])
    assert content == "" and [(c["name"], c["arguments"]) for c in calls] == [("get_weather", text)]
