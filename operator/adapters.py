"""A ModelDeployment's LoRA adapters: the spec's list, where each one's files are in the engine
container, and the engine flags and start-up list that serve them (pure functions).

The list itself stays out of the engine pod template (a changed template rolls every pod): it
is a ConfigMap the engine container reads at start through :data:`WRAPPER`, and the running
replicas load and unload adapters at runtime (``adapter_sync.py``).
"""

from __future__ import annotations

import hashlib
import posixpath
import re
from dataclasses import dataclass
from typing import Any

from kvmesh.operator import crd

MODELS_DIR = "/models"  # the model volume (render.MODELS_DIR)
HF_DIR = f"{MODELS_DIR}/kvmesh-adapters"  # Hugging Face adapters on the shared cache
READY_MARKER = ".kvmesh-model-ready"  # written last by a fetch (render.MODEL_READY_MARKER)
ADAPTER_CLAIMS_DIR = "/adapters"  # an adapter claim other than the model's is mounted here
CONFIG_DIR = "/etc/kvmesh/adapters"
CONFIG_KEY = "lora-modules"  # one `name=path` a line
RUNTIME_UPDATING_ENV = {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"}
NAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._/-]*[A-Za-z0-9])?$")

# `sh -c WRAPPER engine <engine argv...>`: the argv, plus `--lora-modules name=path ...` from
# the ConfigMap (one flag: vLLM keeps only its last --lora-modules). An absolute path not
# there yet, or a Hugging Face adapter whose fetch has not finished, is left out: the operator
# loads it later.
WRAPPER = f"""f={CONFIG_DIR}/{CONFIG_KEY}
first=1
if [ -f "$f" ]; then
  while IFS= read -r m || [ -n "$m" ]; do
    [ -n "$m" ] || continue
    p="${{m#*=}}"
    case "$p" in
      {HF_DIR}/*) ready="$p/{READY_MARKER}" ;;
      /*) ready="$p" ;;
      *) ready="" ;;
    esac
    if [ -n "$ready" ] && [ ! -e "$ready" ]; then echo "adapter $m: not there yet" >&2; continue; fi
    if [ "$first" = 1 ]; then set -- "$@" --lora-modules; first=0; fi
    set -- "$@" "$m"
  done < "$f"
fi
exec "$@"
"""


@dataclass(frozen=True)
class Adapter:
    """One adapter of the spec: its name, source and the directory the engine reads."""

    name: str
    source: dict[str, Any]
    path: str

    @property
    def from_hugging_face(self) -> bool:
        return "huggingFace" in self.source


def declared(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """spec.adapters, then the deprecated engine.loraModules as {name, source: {path}}."""
    alias = [
        {"name": m["name"], "source": {"path": m["path"]}}
        for m in (spec.get("engine") or {}).get("loraModules") or []
        if isinstance(m, dict) and "name" in m and "path" in m
    ]
    return [a for a in spec.get("adapters") or [] if isinstance(a, dict)] + alias


def enabled(spec: dict[str, Any]) -> bool:
    """LoRA is on with spec.lora set or any adapter declared."""
    return "lora" in spec or bool(declared(spec))


def hf_dir(hf: dict[str, Any]) -> str:
    """One directory per (repo, revision) on the shared cache."""
    stamp = f"{hf['repoId']}@{hf.get('revision', 'main')}"
    return posixpath.join(HF_DIR, hashlib.sha256(stamp.encode()).hexdigest()[:10])


def claim_dir(claim: str) -> str:
    return posixpath.join(ADAPTER_CLAIMS_DIR, claim)


def engine_path(spec: dict[str, Any], source: dict[str, Any]) -> str:
    """Where the engine container finds an adapter's directory."""
    if "huggingFace" in source:
        return hf_dir(source["huggingFace"])
    if "pvc" in source:
        pvc = source["pvc"]
        sub = (pvc.get("path") or "").strip("/")
        model_pvc = (spec.get("model") or {}).get("pvc") or {}
        root = MODELS_DIR if pvc["claimName"] == model_pvc.get("claimName") else None
        root = root or claim_dir(pvc["claimName"])
        return posixpath.join(root, sub) if sub else root
    return source["path"]


def adapters(spec: dict[str, Any]) -> list[Adapter]:
    return [Adapter(a["name"], a["source"], engine_path(spec, a["source"])) for a in declared(spec)]


def lora_flags(spec: dict[str, Any]) -> list[str]:
    """--enable-lora and its limits (the same flags for kvmesh's engine and vLLM)."""
    if not enabled(spec):
        return []
    lora = spec.get("lora") or {}
    flags = ["--enable-lora", "--max-loras", str(lora.get("maxLoras", 1))]
    if "maxCpuLoras" in lora:
        flags += ["--max-cpu-loras", str(lora["maxCpuLoras"])]
    return flags + ["--max-lora-rank", str(lora.get("maxRank", 16))]


def wrapped(argv: list[str]) -> list[str]:
    """The engine command reading the adapter list at start."""
    return ["sh", "-c", WRAPPER, "engine", *argv]


def config_data(spec: dict[str, Any]) -> dict[str, str]:
    return {CONFIG_KEY: "".join(f"{a.name}={a.path}\n" for a in adapters(spec))}


def adapter_claims(spec: dict[str, Any]) -> list[str]:
    """Claims of PVC adapters other than the model's own (each mounted under /adapters)."""
    model_claim = ((spec.get("model") or {}).get("pvc") or {}).get("claimName")
    claims = {
        a.source["pvc"]["claimName"]
        for a in adapters(spec)
        if "pvc" in a.source and a.source["pvc"]["claimName"] != model_claim
    }
    return sorted(claims)


def claim_volume_name(claim: str) -> str:
    return f"adapters-{hashlib.sha256(claim.encode()).hexdigest()[:8]}"


def _source(adapter: dict[str, Any]) -> dict[str, Any]:
    source = adapter.get("source")
    return source if isinstance(source, dict) else {}


def rule_errors(spec: dict[str, Any]) -> list[str]:
    """The adapter CEL rules of crd.py, mirrored."""
    errors = []
    items = [a for a in spec.get("adapters") or [] if isinstance(a, dict)]
    names = [a.get("name") for a in items]
    if len(set(names)) != len(names):
        errors.append(crd.ADAPTERS_RULES[0]["message"])
    aliases = (spec.get("engine") or {}).get("loraModules") or []
    for n in names + [m.get("name") for m in aliases if isinstance(m, dict)]:
        if isinstance(n, str) and not NAME_RE.match(n):
            errors.append(f"{n!r}: {crd.ADAPTER_NAME_RULES[0]['message']}")
    for a in items:
        source = _source(a)
        if sum(k in source for k in ("huggingFace", "pvc", "path")) != 1:
            errors.append(f"{a.get('name')}: {crd.ADAPTER_SOURCE_RULES[0]['message']}")
    lora = spec.get("lora") or {}
    cpu, gpu = lora.get("maxCpuLoras"), lora.get("maxLoras", 1)
    if isinstance(cpu, int) and isinstance(gpu, int) and cpu < gpu:
        errors.append(crd.LORA_RULES[0]["message"])
    return errors


def semantic_errors(spec: dict[str, Any], served_name: str, shared_cache: bool) -> list[str]:
    """What passes the schema but cannot work."""
    errors = []
    names = [a.get("name") for a in declared(spec)]
    own = [a.get("name") for a in spec.get("adapters") or [] if isinstance(a, dict)]
    if len(set(names)) != len(names) and len(set(own)) == len(own):  # else the rule says it
        errors.append("adapters: names must be unique across spec.adapters and engine.loraModules")
    if served_name in names:
        errors.append(f"adapters: {served_name!r} is the model's served name")
    for a in declared(spec):
        source = _source(a)
        if "huggingFace" in source and not shared_cache:
            errors.append(
                f"adapters: {a.get('name')} comes from Hugging Face: it needs "
                "model.huggingFace.sharedCache.enabled (adapters are fetched into that cache)"
            )
        pvc = source.get("pvc") if isinstance(source.get("pvc"), dict) else {}
        pvc_path = str(pvc.get("path") or ".")
        if ".." in posixpath.normpath(pvc_path).split("/"):
            errors.append(f"adapters: {a.get('name')}: source.pvc.path must stay inside the volume")
    return errors
