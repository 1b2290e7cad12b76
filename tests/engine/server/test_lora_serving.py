"""Serving LoRA adapters over real HTTP on loopback, in both engine modes (core in its own process,
and in a thread): a request's `model` picks the base or an adapter (greedy tokens as
transformers+peft's), unknown names are a 404 on every route, /v1/models lists the adapters, and
vLLM's runtime load/unload routes (VLLM_ALLOW_RUNTIME_LORA_UPDATING) answer with vLLM's statuses
and messages, between steps, without touching running streams. vllm:lora_requests_info as vLLM's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time

import httpx
import pytest

from kvmesh.common.lora import MODEL_CARD_DIGEST, adapter_digest
from tests.engine.lora.adapters import make_peft_adapter
from tests.engine.server.conftest import ThreadServer, wait_for

MODEL = "tiny"
KEY = "lora-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [1, 415, 2936, 9060, 285, 1142, 28705, 8311]
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> dict[str, str]:
    """PEFT adapters of the tiny model: a, b and c (different ranks and targets), big (rank 32)."""
    root = tmp_path_factory.mktemp("adapters")
    specs = {
        "a": (4, ATTN, 1, False),
        "b": (8, ["gate_proj", "up_proj", "down_proj"], 2, False),
        "c": (2, ["q_proj", "v_proj", "down_proj"], 3, True),
        "big": (32, ["q_proj"], 4, False),
    }
    return {
        name: str(make_peft_adapter(root / name, tiny_model, r, t, seed, rslora=rs))
        for name, (r, t, seed, rs) in specs.items()
    }


@pytest.fixture(scope="module")
def reference(tiny_model, adapters):
    """Greedy continuation of PROMPT by transformers (+ peft for an adapter), fp32."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cache: dict[tuple[str | None, int], list[int]] = {}

    def greedy(adapter: str | None, n: int) -> list[int]:
        if (adapter, n) not in cache:
            model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
            if adapter is not None:
                model = PeftModel.from_pretrained(model, adapters[adapter])
            model.eval()
            ids = torch.tensor([PROMPT])
            with torch.no_grad():
                for _ in range(n):
                    nxt = model(ids).logits[0, -1].argmax()
                    ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            cache[(adapter, n)] = ids[0, len(PROMPT) :].tolist()
        return cache[(adapter, n)]

    return greedy


@pytest.fixture(scope="module", params=["process", "thread"])
def server(request, tiny_model, adapters):
    """`kvmesh serve` with adapter a loaded at start, runtime updating on, behind an API key."""
    old = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "true"
    try:
        srv = ThreadServer(
            [
                "--model",
                tiny_model,
                "--served-model-name",
                MODEL,
                "--dtype",
                "float32",
                "--num-kv-blocks",
                "256",
                "--engine-mode",
                request.param,
                "--api-key",
                KEY,
                "--enable-lora",
                "--max-loras",
                "2",
                "--max-cpu-loras",
                "4",
                "--lora-modules",
                f"a={adapters['a']}",
            ]
        )
    finally:
        if old is None:
            os.environ.pop("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
        else:
            os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = old
    srv.start()
    srv.client = httpx.Client(base_url=srv.url, headers=AUTH, timeout=120)
    yield srv
    srv.client.close()
    srv.stop()
    srv.stop()


def complete(srv, model: str, n: int = 8, **extra) -> httpx.Response:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    return srv.client.post("/v1/completions", json=body)


def tokens(srv, model: str, n: int = 8) -> list[int]:
    r = complete(srv, model, n)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def models(srv) -> list[dict]:
    r = srv.client.get("/v1/models")
    assert r.status_code == 200, r.text
    return r.json()["data"]


def card(srv, name: str, path: str) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": int(srv.state.started),
        "owned_by": "kvmesh",
        "root": path,
        "parent": MODEL,
        "max_model_len": None,
        MODEL_CARD_DIGEST: adapter_digest(path),
    }


def load(srv, name: str, path: str, **extra) -> httpx.Response:
    body = {"lora_name": name, "lora_path": path, **extra}
    return srv.client.post("/v1/load_lora_adapter", json=body)


def unload(srv, name: str) -> httpx.Response:
    return srv.client.post("/v1/unload_lora_adapter", json={"lora_name": name})


def error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    return r.json()["error"]["message"]


# -- selection by name --------------------------------------------------------------------------------
def test_models_lists_the_base_then_each_adapter(server, adapters):
    data = models(server)
    assert [d["id"] for d in data] == [MODEL, "a"]
    assert data[0]["parent"] is None and data[0]["root"] == server.args.model
    assert data[1] == card(server, "a", adapters["a"])


def test_the_model_name_selects_the_adapter(server, reference):
    base, with_a = tokens(server, MODEL), tokens(server, "a")
    assert base == reference(None, 8)
    assert with_a == reference("a", 8)
    assert with_a != base


def test_usage_and_cached_tokens_as_for_the_base(server):
    long = PROMPT * 5  # full blocks to cache
    first = complete(server, "a", prompt=long).json()["usage"]
    again = complete(server, "a", prompt=long).json()["usage"]
    assert first["prompt_tokens"] == again["prompt_tokens"] == len(long)
    assert first["completion_tokens"] == again["completion_tokens"] == 8
    cached = (again.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert cached > 0  # the adapter's own blocks, from the first request


def test_chat_tokenize_and_detokenize_accept_adapter_names(server):
    msgs = [{"role": "user", "content": "hello"}]
    r = server.client.post(
        "/v1/chat/completions",
        json={"model": "a", "messages": msgs, "max_tokens": 3, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "a"
    tok = server.client.post("/tokenize", json={"model": "a", "prompt": "hello world"})
    base = server.client.post("/tokenize", json={"model": MODEL, "prompt": "hello world"})
    assert tok.status_code == 200 and tok.json()["tokens"] == base.json()["tokens"]
    de = server.client.post("/detokenize", json={"model": "a", "tokens": PROMPT})
    assert de.status_code == 200, de.text


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/tokenize", {"prompt": "hi"}),
        ("/detokenize", {"tokens": [1, 2]}),
    ],
)
def test_an_unknown_model_is_a_404_on_every_route(server, path, body):
    r = server.client.post(path, json={"model": "nope", **body})
    assert r.status_code == 404
    assert r.json() == {
        "error": {
            "message": f"The model `nope` does not exist. This server serves `{MODEL}`.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


# -- runtime loads and unloads ---------------------------------------------------------------------------
def test_load_unload_and_reload_in_place(server, adapters, reference):
    r = load(server, "b", adapters["b"])
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'b' added successfully.")
    assert models(server)[1:] == [
        card(server, "a", adapters["a"]),
        card(server, "b", adapters["b"]),
    ]
    assert tokens(server, "b") == reference("b", 8)

    msg = error(load(server, "b", adapters["c"]), 400)
    assert msg == (
        "The lora adapter 'b' has already been loaded. If you want to load the adapter in place, "
        "set 'load_inplace' to True."
    )
    r = load(server, "b", adapters["c"], load_inplace=True)  # b now means c's files
    assert r.status_code == 200, r.text
    assert models(server)[1:] == [
        card(server, "a", adapters["a"]),
        card(server, "b", adapters["c"]),
    ]
    assert tokens(server, "b") == reference("c", 8)

    r = unload(server, "b")
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'b' removed successfully.")
    assert models(server)[1:] == [card(server, "a", adapters["a"])]
    assert error(unload(server, "b"), 404) == "The lora adapter 'b' cannot be found."
    assert error(complete(server, "b"), 404).startswith("The model `b` does not exist.")
    assert tokens(server, "a") == reference("a", 8)  # the others untouched


def test_an_adapter_gone_before_the_core_saw_the_request_is_a_404(server):
    # the server still lists it (an unload racing the request): the core's refusal is the 404
    served = server.state.engine.adapters.loaded
    served["ghost"] = dict(served["a"], name="ghost")
    try:
        msg = error(complete(server, "ghost"), 404)
    finally:
        served.pop("ghost")
    assert msg == f"The model `ghost` does not exist. This server serves `{MODEL}`."
    assert tokens(server, MODEL)  # and the server goes on


def _truncated(src: str, dst) -> str:
    shutil.copytree(src, dst)
    weights = dst / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1])
    return str(dst)


def _foreign_module(src: str, dst) -> str:
    """The adapter with its q_proj weights under the MLP, which has no q_proj."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = dst / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    save_file(
        {k.replace(".self_attn.q_proj.", ".mlp.q_proj."): v for k, v in tensors.items()},
        str(weights),
    )
    return str(dst)


@pytest.mark.parametrize("case", ["rank", "missing", "corrupt", "module"])
def test_a_bad_adapter_is_a_400_naming_it_and_nothing_else_changes(
    server, adapters, tmp_path, case
):
    path = {
        "rank": lambda: adapters["big"],  # rank 32 > --max-lora-rank 16
        "missing": lambda: str(tmp_path / "no-such-adapter"),
        "corrupt": lambda: _truncated(adapters["c"], tmp_path / "corrupt"),
        "module": lambda: _foreign_module(adapters["a"], tmp_path / "foreign"),
    }[case]()
    reason = {
        "rank": "exceeds max_lora_rank 16",
        "missing": "no directory",
        "corrupt": "corrupt weights file",
        "module": "not in the model",
    }[case]
    before = models(server)
    msg = error(load(server, "bad", path), 400)
    assert "'bad'" in msg and reason in msg, msg
    assert models(server) == before
    assert error(complete(server, "bad"), 404).startswith("The model `bad` does not exist.")


def test_a_load_under_a_running_stream_leaves_its_tokens_unchanged(server, adapters):
    n = 400
    alone = tokens(server, "a", n)
    got: list[str] = []

    def stream():
        body = {
            "model": "a",
            "prompt": PROMPT,
            "max_tokens": n,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        with server.client.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    got.append(line[6:])

    t = threading.Thread(target=stream)
    t.start()
    wait_for(lambda: got, timeout=60, interval=0.01)
    assert load(server, "c", adapters["c"]).status_code == 200
    assert unload(server, "c").status_code == 200
    at_unload = len(got)
    t.join(120)
    assert len(got) > at_unload  # the stream was running all along
    ids = [
        i for chunk in got for c in json.loads(chunk)["choices"] for i in c.get("token_ids") or []
    ]
    assert ids == alone


def test_routes_are_behind_the_api_key(server, adapters):
    r = httpx.post(
        f"{server.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": adapters["b"]}
    )
    assert r.status_code == 401
    assert (
        httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code
        == 401
    )
    assert "x" not in [d["id"] for d in models(server)]


# -- metrics ---------------------------------------------------------------------------------------------
LORA_INFO = re.compile(
    r'^vllm:lora_requests_info\{max_lora="(\d+)",running_lora_adapters="([^"]*)",'
    r'waiting_lora_adapters="([^"]*)"\} (\S+)$',
    re.M,
)


def lora_info(srv) -> list[tuple[str, str, str, float]]:
    text = srv.client.get("/metrics").text
    return [(m, r, w, float(v)) for m, r, w, v in LORA_INFO.findall(text)]


def test_lora_requests_info_as_vllms(server):
    text = server.client.get("/metrics").text
    assert "# HELP vllm:lora_requests_info Running stats on lora requests.\n" in text
    assert "# TYPE vllm:lora_requests_info gauge\n" in text
    t0 = time.time()
    got: list = []

    def run():
        got.append(complete(server, "a", n=200))

    th = threading.Thread(target=run)
    th.start()
    busy = wait_for(
        lambda: [s for s in lora_info(server) if s[1] == "a"], timeout=60, interval=0.01
    )
    th.join(120)
    assert busy[0][:3] == ("2", "a", "")
    assert t0 - 1 <= busy[0][3] <= time.time()
    idle = wait_for(lambda: [s for s in lora_info(server) if s[1] == ""], timeout=30)
    assert len(lora_info(server)) == 1  # only the current label set
    assert idle[0][:3] == ("2", "", "") and idle[0][3] >= busy[0][3]


def test_an_adapter_that_fails_at_start_fails_the_load(tiny_model, tmp_path):
    srv = ThreadServer(
        [
            "--model",
            tiny_model,
            "--num-kv-blocks",
            "64",
            "--engine-mode",
            "thread",
            "--enable-lora",
            "--lora-modules",
            f"gone={tmp_path / 'gone'}",
        ]
    )
    try:
        with pytest.raises(RuntimeError, match="adapter 'gone': no directory"):
            srv.start()
    finally:
        srv.stop()


# -- without runtime updating, without --enable-lora ------------------------------------------------------
@pytest.fixture(scope="module")
def plain_server(tiny_model):
    os.environ.pop("VLLM_ALLOW_RUNTIME_LORA_UPDATING", None)
    srv = ThreadServer(
        ["--model", tiny_model, "--served-model-name", MODEL, "--engine-mode", "thread"]
        + ["--num-kv-blocks", "64"]  # in this process: a small cache, not the 4 GiB default
    ).start()
    yield srv
    srv.stop()


def test_without_the_switch_the_routes_do_not_exist(plain_server, adapters):
    r = httpx.post(
        f"{plain_server.url}/v1/load_lora_adapter",
        json={"lora_name": "x", "lora_path": adapters["a"]},
    )
    assert r.status_code == 404
    assert [d["id"] for d in httpx.get(f"{plain_server.url}/v1/models").json()["data"]] == [MODEL]
    assert "vllm:lora_requests_info" not in httpx.get(f"{plain_server.url}/metrics").text
