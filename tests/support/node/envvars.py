"""A container's environment, as the kubelet builds it: the image's ENV, Service variables
(``enableServiceLinks``) and KUBERNETES_SERVICE_HOST/PORT, ``envFrom``, then ``env`` with
``value`` (``$(VAR)`` expanded), ``fieldRef``, ``resourceFieldRef``, ``secretKeyRef`` and
``configMapKeyRef``; and ``$(VAR)`` expansion of the command line."""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Callable
from decimal import Decimal
from typing import Any

_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.\-]*)\)")


class ConfigError(Exception):
    """The container cannot be configured (kubelet: CreateContainerConfigError)."""


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined variables are replaced, undefined ones are kept
    as written, $$ is a literal $."""

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _REF.sub(sub, text)


_SUFFIX = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}


def quantity(text: str) -> Decimal:
    m = re.fullmatch(r"([+-]?[0-9.]+(?:[eE][+-]?\d+)?)([a-zA-Z]*)", str(text).strip())
    if not m or m.group(2) not in _SUFFIX:
        raise ConfigError(f"not a quantity: {text!r}")
    return Decimal(m.group(1)) * Decimal(_SUFFIX[m.group(2)])


def service_variables(services: list[tuple[str, str, list[dict[str, Any]]]]) -> dict[str, str]:
    """Docker-link style variables of (name, clusterIP, ports) Services, as the kubelet sets them."""
    env: dict[str, str] = {}
    for name, cluster_ip, ports in services:
        if not cluster_ip or cluster_ip == "None" or not ports:
            continue
        prefix = name.upper().replace("-", "_")
        env[f"{prefix}_SERVICE_HOST"] = cluster_ip
        env[f"{prefix}_SERVICE_PORT"] = str(ports[0]["port"])
        for port in ports:
            if port.get("name"):
                env[f"{prefix}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}"] = str(
                    port["port"]
                )
        first = ports[0]
        env[f"{prefix}_PORT"] = (
            f"{first.get('protocol', 'TCP').lower()}://{cluster_ip}:{first['port']}"
        )
        for port in ports:
            proto = port.get("protocol", "TCP")
            base = f"{prefix}_PORT_{port['port']}_{proto.upper()}"
            env[base] = f"{proto.lower()}://{cluster_ip}:{port['port']}"
            env[f"{base}_PROTO"] = proto.lower()
            env[f"{base}_PORT"] = str(port["port"])
            env[f"{base}_ADDR"] = cluster_ip
    return env


def _field(pod: dict[str, Any], path: str) -> str:
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.hostIP": status.get("hostIP"),
        "status.podIP": status.get("podIP"),
        "status.hostIPs": ",".join(a["ip"] for a in status.get("hostIPs") or []),
        "status.podIPs": ",".join(a["ip"] for a in status.get("podIPs") or []),
    }
    if path not in simple:
        raise ConfigError(f"unsupported fieldRef.fieldPath {path!r}")
    return simple[path] or ""


def resource_field(
    container: dict[str, Any], ref: dict[str, Any], node_allocatable: dict[str, str]
) -> str:
    kind, _, resource = ref["resource"].partition(".")
    value = ((container.get("resources") or {}).get(kind) or {}).get(resource)
    if (
        value is None
    ):  # unset limits default to the node's allocatable, unset requests to 0 (cpu/memory)
        value = node_allocatable.get(resource, "0") if kind == "limits" else "0"
    divisor = quantity(ref.get("divisor") or "1")
    amount = quantity(value) / divisor
    return str(math.ceil(amount))


Lookup = Callable[
    [str, str], dict[str, Any] | None
]  # (kind, name) -> ConfigMap/Secret in the pod's namespace


def _data(obj: dict[str, Any], kind: str) -> dict[str, str]:
    if kind == "Secret":
        return {
            k: base64.b64decode(v).decode(errors="replace")
            for k, v in (obj.get("data") or {}).items()
        }
    return {
        **(obj.get("data") or {}),
        **{
            k: base64.b64decode(v).decode(errors="replace")
            for k, v in (obj.get("binaryData") or {}).items()
        },
    }


def _key_ref(ref: dict[str, Any], kind: str, lookup: Lookup) -> str | None:
    obj = lookup(kind, ref["name"])
    optional = bool(ref.get("optional"))
    if obj is None:
        if optional:
            return None
        raise ConfigError(f'{kind.lower()} "{ref["name"]}" not found')
    data = _data(obj, kind)
    if ref["key"] not in data:
        if optional:
            return None
        raise ConfigError(
            f"couldn't find key {ref['key']} in {kind} {obj['metadata'].get('namespace')}/{ref['name']}"
        )
    return data[ref["key"]]


def container_env(
    pod: dict[str, Any],
    container: dict[str, Any],
    *,
    base: dict[str, str],
    lookup: Lookup,
    node_allocatable: dict[str, str],
) -> dict[str, str]:
    """``base`` holds the image's ENV, PATH and the Service variables; the container's own
    settings override it."""
    env = dict(base)
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
            if key not in source:
                continue
            ref = source[key]
            obj = lookup(kind, ref["name"])
            if obj is None:
                if ref.get("optional"):
                    continue
                raise ConfigError(f'{kind.lower()} "{ref["name"]}" not found')
            for k, v in _data(obj, kind).items():
                env[prefix + k] = v
    for var in container.get("env") or []:
        name = var["name"]
        if "valueFrom" not in var:
            env[name] = expand(var.get("value", ""), env)
            continue
        source = var["valueFrom"]
        value: str | None
        if "fieldRef" in source:
            value = _field(pod, source["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in source:
            value = resource_field(container, source["resourceFieldRef"], node_allocatable)
        elif "secretKeyRef" in source:
            value = _key_ref(source["secretKeyRef"], "Secret", lookup)
        elif "configMapKeyRef" in source:
            value = _key_ref(source["configMapKeyRef"], "ConfigMap", lookup)
        else:
            raise ConfigError(f"env {name}: unsupported valueFrom {sorted(source)}")
        if value is not None:
            env[name] = value
    return env
