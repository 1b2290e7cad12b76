"""Tool calling through real HTTP and the official ``openai`` client, on a tiny random-weight model:
``required`` and a named function give valid calls because the tools' schemas constrain the output;
``auto`` reads the Hermes format (the model is forced to write it by a structured-output choice, since a
random model never would); the whole flow - request, tool_calls, the tool's result sent back, an
answer - streamed and not; and the 400s that name the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.engine.server.conftest import ThreadServer

MODEL = "tiny"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city, for the next days",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"enum": [1, 2, 3]}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a zone",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"enum": ["UTC", "CET"]}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris tomorrow?"}]
HERMES_CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def server(hermes_tool_server):
    return hermes_tool_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def check_call(call, names=tuple(SCHEMAS)) -> dict:
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    assert call.function.name in names
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


def streamed(client, **kwargs):
    """(content, tool calls as {id, name, arguments}, finish_reason) put back together from a stream."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            assert delta.role or delta.content or delta.tool_calls or choice.finish_reason, (
                "no empty chunk while the parser holds back text"
            )
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                if tc.id is not None:  # a call's first delta: its id, type and name, once
                    assert tc.index not in calls and tc.type == "function" and tc.function.name
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                else:
                    assert tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            if choice.finish_reason:
                finish = choice.finish_reason
    return content, [calls[i] for i in sorted(calls)], finish


def answer_with_result(client, messages, message, call_id: str, stream: bool) -> str:
    """The flow's second turn: the assistant's calls and the tool's result back into the template."""
    messages = messages + [
        message,
        {"role": "tool", "tool_call_id": call_id, "content": '{"celsius": 21}'},
    ]
    if stream:
        content, calls, finish = streamed(
            client, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=6
        )
        assert calls == [] and finish in ("stop", "length")
        return content
    resp = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=6
    )
    assert not resp.choices[0].message.tool_calls and resp.choices[0].finish_reason in (
        "stop",
        "length",
    )
    return resp.choices[0].message.content


def test_required_gives_valid_calls_then_the_result_goes_back(client):
    resp = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=100,
        temperature=1.0,
        seed=3,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    check_call(call)
    assert choice.message.content in ("", None)
    assert isinstance(
        answer_with_result(
            client, ASK, choice.message.model_dump(exclude_none=True), call.id, stream=False
        ),
        str,
    )


def test_required_streams_names_once_then_argument_deltas(client):
    content, calls, finish = streamed(
        client,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=100,
        seed=5,
    )
    assert content == "" and finish == "tool_calls" and len(calls) == 1
    call = calls[0]
    assert call["id"].startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": call["name"], "arguments": call["arguments"]},
            }
        ],
    }
    assert isinstance(answer_with_result(client, ASK, message, call["id"], stream=True), str)


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_called_with_valid_arguments(client, stream):
    named = {"type": "function", "function": {"name": "get_time"}}
    if stream:
        content, calls, finish = streamed(
            client, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=60
        )
        assert [c["name"] for c in calls] == ["get_time"]
        jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS["get_time"])
    else:
        resp = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=60
        )
        finish = resp.choices[0].finish_reason
        [call] = resp.choices[0].message.tool_calls
        check_call(call, ("get_time",))
    assert finish == "stop"  # a forced function keeps "stop", as OpenAI and vLLM answer


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_the_models_hermes_calls(client, stream):
    # the random model is made to write the markup; the server's parser reads it
    forced = {"structured_outputs": {"choice": ["Let me look.\n" + HERMES_CALL]}}
    kwargs = dict(messages=ASK, tools=TOOLS, max_tokens=80, extra_body=forced)
    if stream:
        content, calls, finish = streamed(client, **kwargs)
        names_args = [(c["name"], json.loads(c["arguments"])) for c in calls]
    else:
        resp = client.chat.completions.create(model=MODEL, **kwargs)
        content, finish = resp.choices[0].message.content, resp.choices[0].finish_reason
        names_args = [(c.function.name, check_call(c)) for c in resp.choices[0].message.tool_calls]
    assert content == "Let me look.\n"  # no markup leaks as content
    assert names_args == [("get_weather", {"city": "Paris", "days": 1})]
    assert finish == "tool_calls"


def test_auto_without_a_call_is_plain_content(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=5
    )
    choice = resp.choices[0]
    assert not choice.message.tool_calls and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")


BAD = [
    (
        {"tools": [{"type": "function", "function": {"description": "no name"}}]},
        "tools.0.function.name",
    ),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice.function.name",
    ),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}},
        "tool_choice.function.name",
    ),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}
            ],
            "tool_choice": "required",
        },
        "tools",
    ),  # a parameters schema the grammar backend cannot compile
    ({"tool_choice": "auto"}, "tool_choice"),
    (
        {"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"choice": ["a"]}},
        "tool_choice",
    ),
    (
        {
            "messages": ASK
            + [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "x",
                            "type": "function",
                            "function": {"name": "get_time", "arguments": "{not json"},
                        }
                    ],
                }
            ]
        },
        "messages.1.tool_calls.0.function.arguments",
    ),
    (
        {
            "messages": ASK
            + [{"role": "assistant", "tool_calls": [{"id": "x", "function": {"arguments": "{}"}}]}]
        },
        "messages.1.tool_calls.0.function.name",
    ),
]


@pytest.mark.parametrize("fields,param", BAD, ids=[p for _, p in BAD])
def test_bad_tool_fields_are_a_400_naming_the_field(server, fields, param):
    for stream in (False, True):
        body = {"model": MODEL, "messages": ASK, "max_tokens": 2, "stream": stream, **fields}
        resp = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param, resp.json()


def test_tools_on_completions_are_refused(server):
    resp = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": "x", "tools": TOOLS}, timeout=60
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tools"


def test_required_with_no_tools_is_plain_content(server):
    resp = httpx.post(
        f"{server.url}/v1/chat/completions",
        timeout=60,
        json={"messages": ASK, "tools": [], "tool_choice": "required", "max_tokens": 2},
    )
    assert resp.status_code == 200 and "tool_calls" not in resp.json()["choices"][0]["message"]


def test_auto_needs_the_servers_flags(tiny_model):
    """Without --enable-auto-tool-choice, auto (the default with tools) is vLLM's 400; required works."""
    srv = ThreadServer(
        [
            "--model",
            tiny_model,
            "--served-model-name",
            MODEL,
            "--num-kv-blocks",
            "64",
            "--engine-mode",
            "thread",
        ]
    ).start()
    try:
        for extra in ({}, {"tool_choice": "auto"}):
            resp = httpx.post(
                f"{srv.url}/v1/chat/completions",
                timeout=60,
                json={"messages": ASK, "tools": TOOLS, "max_tokens": 2, **extra},
            )
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "tool_choice"
            assert (
                "--enable-auto-tool-choice and --tool-call-parser"
                in resp.json()["error"]["message"]
            )
        resp = httpx.post(
            f"{srv.url}/v1/chat/completions",
            timeout=60,
            json={"messages": ASK, "tools": TOOLS, "tool_choice": "none", "max_tokens": 2},
        )
        assert resp.status_code == 200
    finally:
        srv.stop()


def test_the_auto_flag_needs_a_parser():
    import argparse

    from kvmesh.engine.server import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    with pytest.raises(ValueError, match="--tool-call-parser"):
        cli.build_state(parser.parse_args(["--enable-auto-tool-choice"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--tool-call-parser", "unknown"])


def test_a_model_deployment_passes_the_tool_flags_to_serve():
    """The CRD's engine.extraArgs reach `kvmesh serve`'s parser as they are."""
    import argparse

    from kvmesh.engine.server import cli
    from kvmesh.operator import render
    from kvmesh.operator import spec as specs

    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"]
    argv = render.engine_args(
        specs.apply_defaults({"model": {"builtin": "x"}, "engine": {"extraArgs": flags}})
    )
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert argv[:2] == ["kvmesh", "serve"]
    args = parser.parse_args(argv[2:])
    assert args.enable_auto_tool_choice and args.tool_call_parser == "llama3_json"


def test_a_resumed_tool_call_stream_continues_the_calls(server):
    """The router's mid-stream resume: the continuation's parser first reads the ids the client has, so
    the client's deltas (the first k tokens' chunks, then the continuation's) are the whole stream's."""
    body = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "required",
        "temperature": 0,
        "max_tokens": 100,
        "return_token_ids": True,
        "stream": True,
    }

    def chunks_of(body):
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200, r.read()
            return [
                json.loads(line[6:])
                for line in r.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"
            ]

    def calls_of(choices):
        calls = {}
        for c in choices:
            for tc in c["delta"].get("tool_calls", []):
                call = calls.setdefault(tc["index"], {"name": None, "arguments": ""})
                if "id" in tc:
                    assert call["name"] is None, "a call is named once"
                    call["name"] = tc["function"]["name"]
                call["arguments"] += tc["function"].get("arguments", "")
        return [calls[i] for i in sorted(calls)]

    whole = [
        ch["choices"][0]
        for ch in chunks_of(body)
        if ch["choices"] and "role" not in ch["choices"][0]["delta"]
    ]
    ids = [t for c in whole for t in c["token_ids"]]
    want = calls_of(whole)
    assert len(want) >= 1 and whole[-1]["finish_reason"] == "tool_calls"
    for k in (2, len(ids) // 2, len(ids) - 2):
        n = next(
            i + 1
            for i in range(len(whole))
            if len([t for c in whole[: i + 1] for t in c["token_ids"]]) >= k
        )
        cont = [
            ch["choices"][0]
            for ch in chunks_of({**body, "resume": {"output_token_ids": ids[:k]}})
            if ch["choices"]
        ]
        assert calls_of(whole[:n] + cont) == want, k
        assert cont[-1]["finish_reason"] == "tool_calls"


def test_calls_cut_by_max_tokens_keep_finish_reason_length(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=3
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "length"
    assert not choice.message.tool_calls and choice.message.content, (
        "an unfinished call is returned as text"
    )
