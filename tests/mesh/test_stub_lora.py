"""The stub engine's LoRA surface (adapters by `model`, /v1/models, lora_requests_info, dynamic
load and unload, KV events with the adapter's keys) and `kvmesh up`'s LoRA flags."""

from __future__ import annotations

import argparse

import httpx
import msgpack
import pytest
import zmq

from kvmesh.common.block_keys import block_keys
from kvmesh.common.engine_load import engine_load
from kvmesh.common.lora import MODEL_CARD_DIGEST, adapter_digest, adapter_identity
from kvmesh.mesh.lora_args import engine_lora_args, lora_module
from kvmesh.mesh.stub_lora import stub_digest
from kvmesh.mesh.up import add_arguments


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=10)


def test_a_stub_serves_adapters_by_model_and_loads_and_unloads_them(
    stub_factory, model_name, tmp_path
):
    real = tmp_path / "real"
    real.mkdir()
    (real / "adapter_config.json").write_text('{"r": 8}')
    (real / "adapter_model.safetensors").write_bytes(b"weights")
    (stub,) = stub_factory(model_name, 1, "--lora-modules", f"real={real}", "--max-loras", "3")
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(stub.events_endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        cards = httpx.get(stub.url + "/v1/models", timeout=5).json()["data"]
        assert [(c["id"], c.get("parent"), c.get(MODEL_CARD_DIGEST)) for c in cards] == [
            (model_name, None, None),
            ("real", model_name, adapter_digest(real)),
        ]
        assert (
            post(stub.url, "/v1/completions", {"model": "nope", "prompt": "x"}).status_code == 404
        )
        loaded = post(stub.url, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/x"})
        assert loaded.status_code == 200, loaded.text
        again = post(stub.url, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/x"})
        assert again.status_code == 400
        prompt = list(range(100, 164))  # 4 blocks of 16
        # the subscriber may miss the first events while it connects: send until one arrives
        events = []
        for _ in range(50):
            resp = post(stub.url, "/v1/completions", {"model": "sql", "prompt": prompt})
            assert resp.status_code == 200 and resp.json()["model"] == "sql"
            if sub.poll(100):
                events = msgpack.unpackb(sub.recv_multipart()[-1])[1]
                break
        stored = [e for e in events if e[0] == "BlockStored"]
        identity = adapter_identity(model_name, "sql", stub_digest("sql", "/x"))
        assert stored and stored[0][1] == block_keys(prompt, identity, 16)
        assert (stored[0][5], stored[0][7]) == (2, "sql")  # lora_id, lora_name
        load = engine_load(httpx.get(stub.url + "/metrics", timeout=5).text)
        assert (load.max_loras, load.active_adapters) == (3, ())
        assert post(stub.url, "/v1/unload_lora_adapter", {"lora_name": "sql"}).status_code == 200
        assert post(stub.url, "/v1/unload_lora_adapter", {"lora_name": "sql"}).status_code == 404
        gone = post(stub.url, "/v1/completions", {"model": "sql", "prompt": prompt})
        assert gone.status_code == 404
    finally:
        sub.close(0)


def test_kvmesh_up_passes_the_lora_flags_to_every_engine(tmp_path):
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(
        [
            "--lora-modules",
            "sql=ad/sql",
            f"chat={tmp_path}",
            "--max-loras",
            "2",
            "--max-lora-rank",
            "8",
        ]
    )
    assert engine_lora_args(args) == [
        "--enable-lora",
        "--lora-modules",
        f"sql={tmp_path.cwd() / 'ad' / 'sql'}",
        f"chat={tmp_path}",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
    ]
    assert engine_lora_args(p.parse_args([])) == []
    assert engine_lora_args(p.parse_args(["--max-loras", "4"])) == [
        "--enable-lora",
        "--max-loras",
        "4",
    ]
    with pytest.raises(argparse.ArgumentTypeError, match="name=path"):
        lora_module("no-path")
