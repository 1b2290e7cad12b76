"""load_adapter: PEFT directories read into per-layer A/B weights, and what it refuses."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from kvmesh.common.lora import adapter_digest
from kvmesh.engine.config import ModelConfig
from kvmesh.engine.lora.adapter import load_adapter
from kvmesh.engine.lora.request import LoRAError, LoRARequest
from tests.engine.lora.adapters import make_peft_adapter


def _load(path, name="a", max_rank=16, base_dir=None):
    config = ModelConfig.from_dir(base_dir)
    return load_adapter(LoRARequest(name, 1, str(path)), config, max_rank)


def test_loads_weights_scaling_and_digest(lora_base_dir, lora_adapter_dirs):
    path = lora_adapter_dirs["attn"]
    a = _load(path, base_dir=lora_base_dir)
    assert (a.name, a.int_id, a.path, a.rank) == ("a", 1, path, 4)
    assert a.digest == adapter_digest(path)
    assert a.scaling == 8 / 4
    saved = load_file(f"{path}/adapter_model.safetensors")
    for i, layer in enumerate(a.layers):
        assert sorted(layer) == ["k_proj", "o_proj", "q_proj", "v_proj"]
        w = layer["q_proj"]
        prefix = f"base_model.model.model.layers.{i}.self_attn.q_proj"
        assert torch.equal(w.a, saved[f"{prefix}.lora_A.weight"])
        assert torch.equal(w.b, saved[f"{prefix}.lora_B.weight"])
        assert w.b.abs().sum() > 0


def test_rslora_scales_by_the_square_root_of_the_rank(lora_base_dir, lora_adapter_dirs):
    a = _load(lora_adapter_dirs["mixed"], base_dir=lora_base_dir)
    assert a.scaling == pytest.approx(4 / math.sqrt(2))
    assert a.layers[0]["up_proj"].scaling == pytest.approx(4 / math.sqrt(2))


def test_rank_and_alpha_patterns_and_layers(lora_base_dir, tmp_path):
    path = make_peft_adapter(
        tmp_path / "p",
        lora_base_dir,
        4,
        ["q_proj", "down_proj"],
        seed=3,
        rank_pattern={"down_proj": 6},
        alpha_pattern={"down_proj": 3},
        layers_to_transform=[1],
    )
    a = _load(path, base_dir=lora_base_dir)
    assert a.layers[0] == {}
    assert sorted(a.layers[1]) == ["down_proj", "q_proj"]
    assert a.layers[1]["down_proj"].rank == 6 and a.layers[1]["down_proj"].scaling == 3 / 6
    assert a.layers[1]["q_proj"].rank == 4 and a.layers[1]["q_proj"].scaling == 8 / 4
    assert a.rank == 6


def test_regex_target_modules(lora_base_dir, tmp_path):
    path = make_peft_adapter(tmp_path / "re", lora_base_dir, 2, r".*\.1\.mlp\.(up|gate)_proj", 4)
    a = _load(path, base_dir=lora_base_dir)
    assert a.layers[0] == {} and sorted(a.layers[1]) == ["gate_proj", "up_proj"]


def test_reads_a_bin_weights_file(lora_base_dir, lora_adapter_dirs, tmp_path):
    src = lora_adapter_dirs["mlp"]
    dst = tmp_path / "bin"
    dst.mkdir()
    shutil.copy(f"{src}/adapter_config.json", dst)
    torch.save(load_file(f"{src}/adapter_model.safetensors"), dst / "adapter_model.bin")
    a, b = _load(dst, base_dir=lora_base_dir), _load(src, base_dir=lora_base_dir)
    assert torch.equal(a.layers[1]["down_proj"].b, b.layers[1]["down_proj"].b)


def _copy(src, tmp_path, name="bad"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _edit_config(path, **changes):
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def _refused(path, base_dir, match, max_rank=16):
    with pytest.raises(LoRAError, match=match) as e:
        _load(path, name="bad-one", max_rank=max_rank, base_dir=base_dir)
    assert "bad-one" in str(e.value)


def test_refuses_truncated_safetensors(lora_base_dir, lora_adapter_dirs, tmp_path):
    path = _copy(lora_adapter_dirs["attn"], tmp_path)
    f = path / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:-1])
    _refused(path, lora_base_dir, "corrupt")


def test_refuses_missing_files(lora_base_dir, lora_adapter_dirs, tmp_path):
    path = _copy(lora_adapter_dirs["attn"], tmp_path)
    (path / "adapter_model.safetensors").unlink()
    _refused(path, lora_base_dir, "no adapter_model")
    _refused(tmp_path / "nowhere", lora_base_dir, "no directory")
    path = _copy(lora_adapter_dirs["attn"], tmp_path, "noconfig")
    (path / "adapter_config.json").unlink()
    _refused(path, lora_base_dir, "adapter_config.json")


def test_refuses_rank_above_max(lora_base_dir, lora_adapter_dirs):
    _refused(lora_adapter_dirs["mlp"], lora_base_dir, "rank 8 .* exceeds max_lora_rank 4", 4)


def test_refuses_unknown_module(lora_base_dir, lora_adapter_dirs, tmp_path):
    path = _copy(lora_adapter_dirs["attn"], tmp_path)
    _edit_config(path, target_modules=["q_proj", "c_attn"])
    _refused(path, lora_base_dir, "c_attn")


def test_refuses_dora_bias_modules_to_save_and_embeddings(
    lora_base_dir, lora_adapter_dirs, tmp_path
):
    for i, (changes, match) in enumerate(
        [
            (dict(use_dora=True), "DoRA"),
            (dict(bias="all"), "bias"),
            (dict(modules_to_save=["lm_head"]), "modules_to_save"),
            (dict(target_modules=["q_proj", "embed_tokens"]), "embedding"),
            (dict(target_modules=["lm_head"]), "LM head"),
        ]
    ):
        path = _copy(lora_adapter_dirs["attn"], tmp_path, f"bad{i}")
        _edit_config(path, **changes)
        _refused(path, lora_base_dir, match)


def test_refuses_a_real_dora_adapter(lora_base_dir, tmp_path):
    path = make_peft_adapter(tmp_path / "dora", lora_base_dir, 2, ["q_proj"], 1, use_dora=True)
    _refused(path, lora_base_dir, "DoRA")


def test_refuses_shape_mismatch(lora_base_dir, lora_adapter_dirs, tmp_path):
    path = _copy(lora_adapter_dirs["attn"], tmp_path)
    _edit_config(path, r=3)
    _refused(path, lora_base_dir, "shape mismatch")
    qwen = tmp_path / "qwen"
    from tests.tiny_models import build_tiny_model

    build_tiny_model(qwen, "tiny-qwen2")
    cfg = json.loads((qwen / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (qwen / "config.json").write_text(json.dumps(cfg))
    _refused(lora_adapter_dirs["mlp"], str(qwen), "shape mismatch")
