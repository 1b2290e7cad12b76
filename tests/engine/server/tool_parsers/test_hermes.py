"""The Hermes parser: whole outputs, and streams split at every character boundary."""

from __future__ import annotations

import json

import pytest

from kvmesh.engine.server.tool_parsers.hermes import HermesToolParser
from tests.engine.server.tool_parsers.streaming import check_stream_matches_whole, replay

ONE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
TWO = (
    ONE
    + '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris", "fmt": "a \\"q\\" }"}}'
    "\n</tool_call>"
)


def test_one_call_reads_its_name_and_arguments_as_written():
    out = HermesToolParser().parse(ONE)
    assert out.content is None
    [call] = out.tool_calls
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "celsius"}
    assert call.id.startswith("chatcmpl-tool-")


def test_two_calls_keep_their_order_and_text_before_them_is_content():
    out = HermesToolParser().parse("Let me check.\n" + TWO)
    assert out.content == "Let me check.\n"
    assert [c.name for c in out.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(out.tool_calls[1].arguments)["fmt"] == 'a "q" }'
    assert len({c.id for c in out.tool_calls}) == 2


def test_text_without_calls_is_content():
    text = "No tools needed: 2 < 3 and <tool is not a tag."
    out = HermesToolParser().parse(text)
    assert out.content == text and out.tool_calls == []


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "f", "arguments": {"a": </tool_call>',  # arguments cut short
        '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>',  # no name
        '<tool_call>\n["f"]\n</tool_call>',  # not an object
        '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',  # a name that is not a string
    ],
)
def test_a_call_that_does_not_parse_leaves_the_output_as_content(text):
    out = HermesToolParser().parse(text)
    assert out.content == text and out.tool_calls == []


def test_an_unclosed_final_block_still_counts():
    out = HermesToolParser().parse('<tool_call>\n{"name": "f", "arguments": {"x": [1, 2]}}')
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("f", {"x": [1, 2]})]


def test_a_call_without_arguments_gets_an_empty_object():
    out = HermesToolParser().parse('<tool_call>{"name": "now"}</tool_call>')
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("now", "{}")]


def test_arguments_written_as_a_json_string_are_unwrapped():
    out = HermesToolParser().parse(
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    )
    assert out.tool_calls[0].arguments == '{"a": 1}'


def test_parallel_calls_off_keeps_the_first_call_only():
    out = HermesToolParser(limit=1).parse(TWO)
    assert [c.name for c in out.tool_calls] == ["get_weather"]
    content, calls = replay(lambda: HermesToolParser(limit=1), list(TWO))
    assert [c["name"] for c in calls] == ["get_weather"]


@pytest.mark.parametrize(
    "text",
    [
        ONE,
        TWO,
        "Sure.\n" + ONE,
        "plain text, no calls <tool",
        "<tool_call>"[:-1],
        '<tool_call>{"arguments": {"k": {"n": [1, {"m": null}]}}, "name": "late"}</tool_call>',
    ],
)
def test_a_stream_split_anywhere_adds_up_to_the_whole_response(text):
    check_stream_matches_whole(HermesToolParser, text)


def test_the_name_is_sent_once_before_any_argument_delta():
    parser = HermesToolParser()
    deltas = [parser.feed(ch) for ch in ONE] + [parser.finish()]
    calls = [c for d in deltas for c in d.calls]
    assert calls[0].name == "get_weather" and calls[0].id and calls[0].arguments in ("", "{")
    assert all(c.name is None and c.id is None for c in calls[1:])
    assert len(calls) > 10, "arguments arrive as they are generated, not at the end"
    assert all(d.content == "" for d in deltas), "the markup never leaks as content"


def test_a_partial_tag_is_held_back_then_released_as_content():
    parser = HermesToolParser()
    assert parser.feed("a <tool_c").content == "a "
    assert parser.feed("at").content == "<tool_cat"
    assert parser.finish().content == ""


def test_a_default_prompt_lists_the_tools_and_the_call_format():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    prompt = HermesToolParser.default_prompt([tool])
    assert json.dumps(tool) in prompt and "<tool_call>" in prompt
    assert (
        HermesToolParser.render_call("f", {"a": 1})
        == '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    )
