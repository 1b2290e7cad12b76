"""The adapter identity contract: digests of an adapter's files, the root its blocks chain from,
and the heartbeat and metrics fields that carry adapters."""

from __future__ import annotations

import pytest

from kvmesh.common.block_keys import root_key
from kvmesh.common.engine_load import engine_load
from kvmesh.common.lora import (
    adapter_digest,
    adapter_identity,
    decode_adapters,
    encode_adapters,
)
from kvmesh.common.redis_layout import Heartbeat


def _adapter(tmp_path, name, config=b'{"r": 8}', weights=b"\x01\x02"):
    d = tmp_path / name
    d.mkdir()
    (d / "adapter_config.json").write_bytes(config)
    (d / "adapter_model.safetensors").write_bytes(weights)
    return d


def test_the_same_files_give_the_same_digest_anywhere(tmp_path):
    a = _adapter(tmp_path, "a")
    b = _adapter(tmp_path, "b")
    assert adapter_digest(a) == adapter_digest(b)
    assert len(adapter_digest(a)) == 16


@pytest.mark.parametrize("field", ["config", "weights"])
def test_new_weights_or_config_change_the_digest_and_the_root(tmp_path, field):
    a = _adapter(tmp_path, "a")
    kw = {"config": b'{"r": 16}'} if field == "config" else {"weights": b"\x01\x03"}
    b = _adapter(tmp_path, "b", **kw)
    assert adapter_digest(a) != adapter_digest(b)
    ra = root_key(adapter_identity("base", "x", adapter_digest(a)))
    rb = root_key(adapter_identity("base", "x", adapter_digest(b)))
    assert ra != rb != root_key("base")


def test_the_root_separates_base_model_and_name(tmp_path):
    ids = {
        adapter_identity("base", "x", "d"),
        adapter_identity("other", "x", "d"),
        adapter_identity("base", "y", "d"),
        "base",
    }
    assert len({root_key(i) for i in ids}) == 4


def test_a_directory_without_weights_has_no_digest(tmp_path):
    d = tmp_path / "a"
    d.mkdir()
    (d / "adapter_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError):
        adapter_digest(d)


def test_adapters_field_round_trips_and_rejects_garbage():
    assert decode_adapters(encode_adapters({"b": "2", "a": "1"})) == {"a": "1", "b": "2"}
    for bad in ["", "[1]", "{", '{"a": 1}', '{"": "x"}', None]:
        assert decode_adapters(bad) == {}
    assert len(decode_adapters(encode_adapters({f"a{i}": "d" for i in range(50)}), limit=8)) == 8


def test_heartbeat_carries_adapters_only_from_an_engine_serving_them():
    plain = Heartbeat(pod="p", url="u").to_mapping()
    assert not {"adapters", "active_adapters", "max_loras"} & set(plain)
    hb = Heartbeat(pod="p", url="u", adapters={"a": "d1"}, active_adapters=("a",), max_loras=2)
    back = Heartbeat.from_mapping("p", hb.to_mapping())
    assert (back.adapters, back.active_adapters, back.max_loras) == ({"a": "d1"}, ("a",), 2)


def test_lora_requests_info_keeps_the_newest_sample():
    text = (
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",waiting_lora_adapters="c"} 20\n'
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="z",waiting_lora_adapters=""} 10\n'
    )
    load = engine_load(text)
    assert (load.max_loras, load.active_adapters, load.waiting_adapters) == (4, ("a", "b"), ("c",))
    assert engine_load("vllm:num_requests_running 1\n").max_loras == 0
