"""Convert a built-in GGUF model once into a cached Hugging Face directory.

The GGUF is dequantised to fp32 by transformers' GGUF loader, then saved as
safetensors with its tokenizer (tokenizer.json + chat template). A file lock
makes concurrent engines (`kvmesh up` starts several) convert only once; the
result is written to a temporary directory and renamed into place, so a
crashed conversion never leaves a half-written model behind.
"""

from __future__ import annotations

import fcntl
import shutil
import tempfile
from pathlib import Path

from tqdm import tqdm

from kvmesh.common.model_lookup import (
    BuiltinModel,
    ModelNotConverted,
    builtin_gguf_path,
    find_model_dir,
)


def resolve_model_dir(model: str) -> Path:
    """A Hugging Face directory for `model`: a path, or a built-in name, converted on first use
    (kvmesh.common.model_lookup.find_model_dir only looks up; conversion is the engine's)."""
    try:
        return find_model_dir(model)
    except ModelNotConverted as missing:
        return convert_builtin(missing.model, missing.target)


def convert_builtin(model: BuiltinModel, target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{target.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").exists() and (target / "tokenizer.json").exists():
            return target  # another process finished while we waited
        gguf = builtin_gguf_path(model)
        with tqdm(total=4, desc=f"converting {model.name}", unit="step") as bar:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            bar.set_postfix_str("reading tokenizer")
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            bar.update()
            bar.set_postfix_str("dequantising GGUF weights")
            hf_model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
            )
            bar.update()
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
            try:
                bar.set_postfix_str("writing safetensors")
                _save_dequantised(hf_model, tmp)
                bar.update()
                bar.set_postfix_str("writing tokenizer")
                tokenizer.save_pretrained(tmp)
                bar.update()
                if target.exists():
                    shutil.rmtree(target)
                tmp.rename(target)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
    return target


def _save_dequantised(hf_model, out: Path) -> None:
    """save_pretrained refuses GGUF-loaded models; the weights are plain fp32 by now."""
    from safetensors.torch import save_file

    config = hf_model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    state = {k: v.detach().contiguous() for k, v in hf_model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # shared with embed_tokens
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    if getattr(hf_model, "generation_config", None) is not None:
        hf_model.generation_config.save_pretrained(out)
