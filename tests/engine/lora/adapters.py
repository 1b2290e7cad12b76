"""PEFT LoRA adapters with non-zero random weights on a tiny checkpoint, for the LoRA tests."""

from __future__ import annotations

from pathlib import Path

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_peft_adapter(
    tmp_dir,
    base_dir,
    rank: int,
    targets,
    seed: int,
    rslora: bool = False,
    alpha: float | None = None,
    **lora_config,
) -> Path:
    """Save a PEFT adapter of `base_dir` in `tmp_dir` (created) and return its path.

    `targets`: PEFT's target_modules (a list, or a regex string). A and B are both random and
    non-zero (PEFT starts B at zero, which would make every adapter the base model), scaled so
    the adapter moves the logits visibly. `lora_config`: further LoraConfig fields.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = Path(tmp_dir)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else 2 * rank,
        target_modules=list(targets) if not isinstance(targets, str) else targets,
        lora_dropout=0.0,
        use_rslora=rslora,
        **lora_config,
    )
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    return path
