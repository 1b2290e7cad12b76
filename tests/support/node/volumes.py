"""A pod's volumes as directories under the pod's state directory (emptyDir, secret,
configMap, downwardAPI, projected with ServiceAccount tokens from the TokenRequest API),
or directories of the host (hostPath; a PersistentVolumeClaim's bound PV's hostPath), and
the bind mounts (source -> mountPath, subPath, readOnly) of each container.

``refresh()`` brings the secret, configMap, downwardAPI and projected volumes up to date, as
the kubelet's periodic sync does: changed keys are rewritten, removed ones deleted, and a
ServiceAccount token is requested anew once 80% of its lifetime has passed. Files mounted by
subPath keep their content (the kubelet does not update them either)."""

from __future__ import annotations

import base64
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvmesh_testing.node.envvars import ConfigError, _field, expand, resource_field

Lookup = Callable[[str, str], dict[str, Any] | None]
TokenRequest = Callable[[str, dict[str, Any]], str]  # (serviceAccount, TokenRequest spec) -> token


def _write(path: Path, content: bytes, mode: int | None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(content)
    if mode is not None:
        os.chmod(tmp, mode)
    os.replace(tmp, path)


def _key_files(
    obj: dict[str, Any] | None, kind: str, ref: dict[str, Any], name: str
) -> dict[str, bytes]:
    """{relative path: content} of a secret/configMap source (its items, or every key)."""
    if obj is None:
        if ref.get("optional"):
            return {}
        raise ConfigError(f'{kind.lower()} "{name}" not found')
    data: dict[str, bytes] = {}
    if kind == "Secret":
        data = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
    else:
        data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
        data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
    if not ref.get("items"):
        return data
    files = {}
    for item in ref["items"]:
        if item["key"] not in data:
            if ref.get("optional"):
                continue
            raise ConfigError(f"{kind} {name} has no key {item['key']!r}")
        files[item["path"]] = data[item["key"]]
    return files


def _downward_files(
    pod: dict[str, Any], items: list[dict[str, Any]], allocatable: dict[str, str]
) -> dict[str, bytes]:
    files = {}
    for item in items:
        if "fieldRef" in item:
            path = item["fieldRef"]["fieldPath"]
            meta = pod["metadata"]
            if path in ("metadata.labels", "metadata.annotations"):
                values = meta.get(path.split(".")[1]) or {}
                text = "\n".join(f'{k}="{v}"' for k, v in sorted(values.items()))
            else:
                text = _field(pod, path)
        else:
            ref = item["resourceFieldRef"]
            container = next(
                c
                for c in pod["spec"]["containers"]
                if c["name"] == ref.get("containerName", pod["spec"]["containers"][0]["name"])
            )
            text = resource_field(container, ref, allocatable)
        files[item["path"]] = text.encode()
    return files


class PodVolumes:
    def __init__(
        self,
        pod: dict[str, Any],
        root: Path,
        *,
        lookup: Lookup,
        request_token: TokenRequest,
        claim_path: Callable[[str], str],
        allocatable: dict[str, str],
    ) -> None:
        self.pod, self.root = pod, root
        self.lookup, self.request_token, self.claim_path = lookup, request_token, claim_path
        self.allocatable = allocatable
        self.paths: dict[str, Path] = {}
        self.written: dict[str, set[str]] = {}  # volume -> the files this node wrote into it
        self.tokens: dict[tuple[str, str, str], tuple[str, float]] = {}  # -> (token, renew at)

    def prepare(self) -> None:
        """Make every volume of the pod; raise ConfigError naming the first that cannot be made."""
        for volume in self.pod["spec"].get("volumes") or []:
            self.paths[volume["name"]] = self._prepare(volume)

    REFRESHED = ("secret", "configMap", "downwardAPI", "projected")

    def refresh(self) -> None:
        """Rewrite what changed in the pod's API-backed volumes; keep the old content of one
        whose source cannot be read now."""
        for volume in self.pod["spec"].get("volumes") or []:
            if any(kind in volume for kind in self.REFRESHED) and volume["name"] in self.paths:
                try:
                    self._prepare(volume)
                except (
                    Exception
                ):  # the API server unreachable, a Secret deleted: try again next sync
                    pass

    def _fill(self, directory: Path, files: dict[str, bytes], mode: int | None) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        for rel, content in files.items():
            path = directory / rel
            if not path.exists() or path.read_bytes() != content:
                _write(path, content, mode)
        previous = self.written.get(directory.name, set())
        for rel in previous - set(files):
            (directory / rel).unlink(missing_ok=True)
        self.written[directory.name] = set(files)

    def _prepare(self, volume: dict[str, Any]) -> Path:
        name = volume["name"]
        directory = self.root / name
        if "emptyDir" in volume:
            directory.mkdir(parents=True, exist_ok=True)
            return directory
        if "hostPath" in volume:
            path = Path(volume["hostPath"]["path"])
            kind = volume["hostPath"].get("type", "")
            if kind == "DirectoryOrCreate":
                path.mkdir(parents=True, exist_ok=True)
            elif kind == "FileOrCreate" and not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch()
            elif kind and not path.exists():
                raise ConfigError(f"hostPath {path} of volume {name!r} does not exist")
            return path
        if "persistentVolumeClaim" in volume:
            return Path(self.claim_path(volume["persistentVolumeClaim"]["claimName"]))
        if "secret" in volume:
            ref = volume["secret"]
            files = _key_files(
                self.lookup("Secret", ref["secretName"]), "Secret", ref, ref["secretName"]
            )
            self._fill(directory, files, ref.get("defaultMode", 0o644))
            return directory
        if "configMap" in volume:
            ref = volume["configMap"]
            files = _key_files(self.lookup("ConfigMap", ref["name"]), "ConfigMap", ref, ref["name"])
            self._fill(directory, files, ref.get("defaultMode", 0o644))
            return directory
        if "downwardAPI" in volume:
            ref = volume["downwardAPI"]
            self._fill(
                directory,
                _downward_files(self.pod, ref.get("items") or [], self.allocatable),
                ref.get("defaultMode", 0o644),
            )
            return directory
        if "projected" in volume:
            self._fill(
                directory,
                self._projected(volume["projected"]),
                volume["projected"].get("defaultMode", 0o644),
            )
            return directory
        raise ConfigError(
            f"volume {name!r}: unsupported volume type {sorted(set(volume) - {'name'})} "
            f"(docs/local-cluster.md)"
        )

    def _projected(self, projected: dict[str, Any]) -> dict[str, bytes]:
        files: dict[str, bytes] = {}
        for source in projected.get("sources") or []:
            if "serviceAccountToken" in source:
                sat = source["serviceAccountToken"]
                spec: dict[str, Any] = {
                    "expirationSeconds": int(sat.get("expirationSeconds", 3600)),
                    "boundObjectRef": {
                        "kind": "Pod",
                        "apiVersion": "v1",
                        "name": self.pod["metadata"]["name"],
                        "uid": self.pod["metadata"]["uid"],
                    },
                }
                if sat.get("audience"):
                    spec["audiences"] = [sat["audience"]]
                sa = self.pod["spec"].get("serviceAccountName") or "default"
                key = (sa, sat["path"], sat.get("audience") or "")
                token, renew_at = self.tokens.get(key, ("", 0.0))
                if time.monotonic() >= renew_at:
                    token = self.request_token(sa, spec)
                    self.tokens[key] = (token, time.monotonic() + 0.8 * spec["expirationSeconds"])
                files[sat["path"]] = token.encode()
            elif "configMap" in source:
                ref = source["configMap"]
                files.update(
                    _key_files(self.lookup("ConfigMap", ref["name"]), "ConfigMap", ref, ref["name"])
                )
            elif "secret" in source:
                ref = source["secret"]
                files.update(
                    _key_files(self.lookup("Secret", ref["name"]), "Secret", ref, ref["name"])
                )
            elif "downwardAPI" in source:
                files.update(
                    _downward_files(
                        self.pod, source["downwardAPI"].get("items") or [], self.allocatable
                    )
                )
            else:
                raise ConfigError(f"projected volume source {sorted(source)} is not supported")
        return files

    def mounts(self, container: dict[str, Any], env: dict[str, str]) -> list[dict[str, Any]]:
        """The bind mounts of one container's volumeMounts."""
        mounts = []
        for vm in container.get("volumeMounts") or []:
            if vm["name"] not in self.paths:
                raise ConfigError(f"volumeMount {vm['name']!r} names no volume of the pod")
            source = self.paths[vm["name"]]
            sub = vm.get("subPath") or (
                expand(vm["subPathExpr"], env) if vm.get("subPathExpr") else ""
            )
            if sub:
                if sub.startswith("/") or ".." in Path(sub).parts:
                    raise ConfigError(f"subPath {sub!r} must be a relative path inside the volume")
                source = source / sub
                if not source.exists():  # the kubelet makes a missing subPath a directory
                    source.mkdir(parents=True, exist_ok=True)
            mounts.append(
                {
                    "source": str(source),
                    "target": vm["mountPath"],
                    "readOnly": bool(vm.get("readOnly")),
                }
            )
        return mounts
