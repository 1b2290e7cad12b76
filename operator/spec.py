"""Defaulting and validation of a ModelDeployment spec, from the schema in crd.py.

The API server applies the CRD's defaults and CEL rules at admission. The operator
does the same again (the same schema data, the same rules mirrored in Python) and
adds checks the schema cannot express, so a spec that slipped through (an API
server without CEL, a resource created before a schema change) gets a clear
``Ready=False`` condition and no crash loop.
"""

from __future__ import annotations

import copy
import posixpath
import re
from typing import Any

import jsonschema

from kvmesh.operator import adapters, crd, kv_offload

# Kubernetes object names of children are "<name>-<suffix>"; the longest suffix
# is "-engine" / "-router" / "-redis-url" (9); Service names must be DNS-1035 labels (63).
MAX_NAME_LENGTH = 63 - len("-redis-url")
GPU = "nvidia.com/gpu"


def apply_defaults(spec: dict[str, Any], schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """A copy of ``spec`` with the schema's defaults filled in, as the API server does
    (a default applies where the field is absent and its parent object exists)."""
    schema = crd.SPEC_SCHEMA if schema is None else schema
    return _default(copy.deepcopy(spec), schema)


def _default(value: Any, schema: dict[str, Any]) -> Any:
    if isinstance(value, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = _default(value[key], sub)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_default(v, schema["items"]) for v in value]
    return value


def _schema_errors(spec: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft4Validator(
        crd.SPEC_SCHEMA
    )  # draft 4: boolean exclusiveMinimum, like OpenAPI v3
    errors = []
    for err in sorted(validator.iter_errors(spec), key=lambda e: list(e.absolute_path)):
        path = ".".join(str(p) for p in err.absolute_path)
        errors.append(f"spec{'.' + path if path else ''}: {err.message}")
    return errors


def _rule_errors(spec: dict[str, Any]) -> list[str]:
    """The CEL rules of crd.py, mirrored in Python (tests check both agree)."""
    errors = []
    model = spec.get("model") or {}
    if sum(k in model for k in ("builtin", "huggingFace", "pvc")) != 1:
        errors.append(crd.MODEL_RULES[0]["message"])
    engine = spec.get("engine") or {}
    if (
        "drainTimeoutSeconds" in engine
        and "terminationGracePeriodSeconds" in engine
        and (
            engine["drainTimeoutSeconds"]
            + engine.get("preStopSleepSeconds", crd.DEFAULT_PRESTOP_SLEEP)
            >= engine["terminationGracePeriodSeconds"]
        )
    ):
        errors.append(crd.ENGINE_RULES[0]["message"])
    auto = spec.get("autoscaling")
    if (
        auto is not None
        and "minReplicas" in auto
        and auto["minReplicas"] > auto.get("maxReplicas", 1)
    ):
        errors.append(crd.AUTOSCALING_RULES[0]["message"])
    redis = spec.get("redis") or {}
    if redis.get("mode") == "external" and "url" not in redis and "secretRef" not in redis:
        errors.append(crd.REDIS_RULES[0]["message"])
    if re.match(r"^rediss?://[^/]*@", str(redis.get("url", ""))):
        errors.append(crd.REDIS_RULES[1]["message"])
    rollout = engine.get("rollout") or {}
    if str(rollout.get("maxSurge", 1)) in ("0", "0%") and str(rollout.get("maxUnavailable", 1)) in (
        "0",
        "0%",
    ):
        errors.append(crd.ROLLOUT_RULES[0]["message"])
    errors += _flow_rule_errors((spec.get("router") or {}).get("flowControl") or {})
    errors += adapters.rule_errors(spec)
    errors += kv_offload.rule_errors(spec)
    message = crd._INT_OR_PERCENT["x-kubernetes-validations"][0]["message"]
    for path, value in _int_or_percent_values(spec):
        if not (
            (isinstance(value, int) and not isinstance(value, bool) and value >= 0)
            or (isinstance(value, str) and re.fullmatch(r"[0-9]+%", value))
        ):
            errors.append(f"{path}: {message}")
    return errors


def _flow_rule_errors(flow: dict[str, Any]) -> list[str]:
    errors = []
    bands = [b for b in flow.get("bands") or [] if isinstance(b, dict)]
    names = [b.get("name") for b in bands]
    if len(set(names)) != len(names):
        errors.append(crd.FLOW_RULES[0]["message"])
    priorities = [b.get("priority") for b in bands]
    if len(set(priorities)) != len(priorities):
        errors.append(crd.FLOW_RULES[1]["message"])
    if "bands" in flow and "defaultBand" in flow and flow["defaultBand"] not in names:
        errors.append(crd.FLOW_RULES[2]["message"])
    return errors


def _int_or_percent_values(spec: dict[str, Any]) -> list[tuple[str, Any]]:
    engine, router = spec.get("engine") or {}, spec.get("router") or {}
    out = [
        (f"engine.rollout.{k}", (engine.get("rollout") or {})[k])
        for k in ("maxSurge", "maxUnavailable")
        if k in (engine.get("rollout") or {})
    ]
    for where, obj in (("engine", engine), ("router", router)):
        pdb = obj.get("podDisruptionBudget") or {}
        if "maxUnavailable" in pdb:
            out.append((f"{where}.podDisruptionBudget.maxUnavailable", pdb["maxUnavailable"]))
    return out


def _semantic_errors(name: str, spec: dict[str, Any]) -> list[str]:
    """What passes the schema but cannot work."""
    errors = []
    if len(name) > MAX_NAME_LENGTH:
        errors.append(
            f"metadata.name is {len(name)} characters; at most {MAX_NAME_LENGTH} leave room "
            "for the child object names"
        )
    resources = (spec.get("engine") or {}).get("resources") or {}
    req, lim = resources.get("requests") or {}, resources.get("limits") or {}
    if GPU in req and str(req[GPU]) != str(lim.get(GPU, req[GPU])):
        errors.append(
            f"engine.resources: {GPU} requests must equal limits (extended resources cannot overcommit)"
        )
    hf = (spec.get("model") or {}).get("huggingFace") or {}
    shared = bool((hf.get("sharedCache") or {}).get("enabled"))
    errors += adapters.semantic_errors(spec, served_model_name(spec), shared)
    errors += kv_offload.semantic_errors(spec, (spec.get("engine") or {}).get("kind") == "vllm")
    pvc = (spec.get("model") or {}).get("pvc") or {}
    if ".." in posixpath.normpath(pvc.get("path", "") or ".").split("/"):
        errors.append("model.pvc.path must stay inside the volume (no '..')")
    return errors


def validate(name: str, spec: dict[str, Any]) -> list[str]:
    """All problems with a (defaulted) spec; empty when it can be deployed."""
    errors = _schema_errors(spec)
    errors += _rule_errors(spec)
    errors += _semantic_errors(name, spec)
    return errors


def served_model_name(spec: dict[str, Any]) -> str:
    """The name clients ask for; also the block-key model identity."""
    model = spec.get("model") or {}
    if model.get("servedModelName"):
        return model["servedModelName"]
    if "builtin" in model:
        return model["builtin"]
    if "huggingFace" in model:
        return model["huggingFace"]["repoId"]
    if "pvc" in model:
        path = (model["pvc"].get("path") or "").strip("/")
        return posixpath.basename(path) or model["pvc"]["claimName"]
    return crd.DEFAULT_MODEL
