"""Fixtures of the LoRA tests: a tiny Llama checkpoint and PEFT adapters of it (built once)."""

from __future__ import annotations

import pytest

from tests.engine.lora.adapters import make_peft_adapter
from tests.tiny_models import build_tiny_model

# name -> (rank, targets, seed, rslora): different ranks and target sets, one with rsLoRA.
ADAPTERS = {
    "attn": (4, ["q_proj", "k_proj", "v_proj", "o_proj"], 11, False),
    "mlp": (8, ["gate_proj", "down_proj"], 12, False),
    "mixed": (2, ["q_proj", "v_proj", "up_proj", "down_proj", "o_proj"], 13, True),
}


@pytest.fixture(scope="session")
def lora_base_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("lora-base"), "tiny-llama"))


@pytest.fixture(scope="session")
def lora_adapter_dirs(tmp_path_factory, lora_base_dir) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-adapters")
    return {
        name: str(make_peft_adapter(root / name, lora_base_dir, r, t, seed, rslora=rs))
        for name, (r, t, seed, rs) in ADAPTERS.items()
    }


@pytest.fixture(scope="session")
def qwen2_lora(tmp_path_factory) -> tuple[str, dict[str, str]]:
    """A tiny Qwen2 (q/k/v bias, tied embeddings) and two adapters of it."""
    root = tmp_path_factory.mktemp("lora-qwen2")
    base = str(build_tiny_model(root / "base", "tiny-qwen2"))
    adapters = {
        "qa": make_peft_adapter(root / "qa", base, 4, ["q_proj", "k_proj", "down_proj"], 21),
        "qb": make_peft_adapter(root / "qb", base, 8, ["v_proj", "gate_proj", "up_proj"], 22, True),
    }
    return base, {k: str(v) for k, v in adapters.items()}
