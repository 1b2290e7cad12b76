"""Helpers: a parser's stream of deltas, put back together as one message."""

from __future__ import annotations

import json
from collections.abc import Callable

from kvmesh.engine.server.tool_parsers import ToolParser


def replay(make: Callable[[], ToolParser], pieces: list[str]) -> tuple[str, list[dict]]:
    """(content, calls) of a stream of ``pieces``: every call named once by its first delta, in order,
    its arguments the concatenation of its deltas."""
    parser = make()
    content, calls = "", []
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    for d in deltas:
        content += d.content
        for call in d.calls:
            if call.id is not None:
                assert call.index == len(calls), "a call's first delta names it, in order"
                assert call.name
                calls.append({"id": call.id, "name": call.name, "arguments": call.arguments})
            else:
                assert call.name is None
                assert call.index == len(calls) - 1, "argument deltas continue the latest call"
                calls[call.index]["arguments"] += call.arguments
        assert "<tool_call>" not in d.content and "</tool_call>" not in d.content, (
            "markup leaked as content"
        )
    return content, calls


def every_split(text: str):
    """The text in two pieces at every boundary, and one character at a time."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)


def check_stream_matches_whole(make: Callable[[], ToolParser], text: str) -> None:
    whole = make().parse(text)
    want_calls = [{"name": c.name, "arguments": c.arguments} for c in whole.tool_calls]
    for pieces in every_split(text):
        content, calls = replay(make, pieces)
        assert [{"name": c["name"], "arguments": c["arguments"]} for c in calls] == want_calls, (
            pieces
        )
        assert content == (whole.content or ""), pieces
    for call in want_calls:
        json.loads(call["arguments"])
