"""A stateful Kubernetes API emulator for the operator tests: kmock's
KubernetesEmulator, extended with what a real API server does and the operator
relies on:

* resourceVersion, uid, generation (bumped on spec changes), creationTimestamp;
* server-side apply (``application/apply-patch+yaml``, upsert, fields the applier
  omits keep other managers' values, e.g. a Deployment's replicas), merge patch
  and JSON patch (with ``test`` ops -> 422);
* ``status`` and ``scale`` subresources (a main-resource patch ignores status);
* label selectors on lists; finalizers and ``deletionTimestamp``;
* garbage collection of dependents through ownerReferences (also of a dependent created
  after its owner is gone);
* fault injection for transient errors.

Discovery and the request log stay kmock's; watches follow resourceVersion like the
API server's (kmock's replay everything on connect, which races with fast patches).
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import json
import re
import uuid
from typing import Any

import aiohttp.web
import jsonpatch
import kmock
import yaml
from kmock._internal import enums, references

NOW = lambda: datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: E731


def _merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = _merge(out.get(k), v)
    return out


def _match_selector(labels: dict[str, str], selector: str) -> bool:
    for term in filter(None, (t.strip() for t in re.split(r",(?![^()]*\))", selector))):
        if m := re.fullmatch(r"(\S+)\s+(in|notin)\s+\((.*)\)", term):
            key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",")}
            if (labels.get(key) in values) != (op == "in"):
                return False
        elif "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.split("==", 1) if "==" in term else term.split("=", 1)
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


class Fault:
    def __init__(self, method: str, path_re: str, status: int, times: int) -> None:
        self.method, self.path_re, self.status, self.times = (
            method.upper(),
            re.compile(path_re),
            status,
            times,
        )


class K8sEmulator(kmock.KubernetesEmulator):
    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._rv = itertools.count(1)
        self.faults: list[Fault] = []
        self.events_log: list[
            tuple[int, Any, str | None, dict[str, Any]]
        ] = []  # (rv, resource, ns, event)
        self._changed = asyncio.Condition()
        self.register("v1/events", "Event")
        self.register("events.k8s.io/v1/events", "Event")
        # For kopf's discovery (the backbone resources it waits for).
        self.register("v1/namespaces", "Namespace", namespaced=False)
        self.register(
            "apiextensions.k8s.io/v1/customresourcedefinitions",
            "CustomResourceDefinition",
            namespaced=False,
        )

    # -- set-up helpers for tests ------------------------------------------------
    def register(
        self,
        key: str,
        kind: str,
        *,
        namespaced: bool = True,
        subresources: tuple[str, ...] = (),
        shortnames: tuple[str, ...] = (),
    ) -> None:
        self.resources[key] = kmock.ResourceInfo(
            kind=kind,
            singular=kind.lower(),
            namespaced=namespaced,
            shortnames=set(shortnames),
            verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
            subresources=set(subresources),
        )

    def inject_fault(self, method: str, path_re: str, status: int = 500, times: int = 1) -> None:
        self.faults.append(Fault(method, path_re, status, times))

    def fetch_object(self, key: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        res = references.resource(key)
        k = (res, namespace, name)
        if k not in self._objects or self._objects[k].deleted:
            return None
        return copy.deepcopy(self._objects[k].raw)

    def list_objects(self, key: str, namespace: str | None = None) -> list[dict[str, Any]]:
        res = references.resource(key)
        return [
            copy.deepcopy(o.raw)
            for (r, ns, _), o in list(self._objects.items())
            if r == res and not o.deleted and (namespace is None or ns == namespace)
        ]

    async def put_object(self, key: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Create or replace an object from the test side (e.g. a controller's status)."""
        res = references.resource(key)
        async with self._lock:
            ns, name = obj["metadata"].get("namespace"), obj["metadata"]["name"]
            old = self.fetch_object(key, ns, name)
            new = copy.deepcopy(obj)
            if old is None:
                self._init_meta(new)
                return await self._store(res, ns, name, new, "ADDED")
            new["metadata"] = {**old["metadata"], **new["metadata"]}
            self._bump(old, new)
            return await self._store(res, ns, name, new, "MODIFIED")

    async def patch_status(
        self, key: str, namespace: str, name: str, status: dict[str, Any]
    ) -> None:
        obj = self.fetch_object(key, namespace, name)
        assert obj is not None, (key, namespace, name)
        obj["status"] = _merge(obj.get("status") or {}, status)
        await self.put_object(key, obj)

    async def delete_object(self, key: str, namespace: str | None, name: str) -> None:
        async with self._lock:
            await self._delete(references.resource(key), namespace, name)

    # -- internals ---------------------------------------------------------------
    def _info(self, res: references.resource) -> kmock.ResourceInfo | None:
        for r in self.resources:
            if r == res:
                return self.resources[r]
        return None

    def _init_meta(self, obj: dict[str, Any]) -> None:
        meta = obj.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", NOW())
        meta["resourceVersion"] = str(next(self._rv))
        meta["generation"] = 1

    def _bump(self, old: dict[str, Any], new: dict[str, Any]) -> bool:
        """Set resourceVersion/generation on ``new``; False if nothing changed."""
        for f in ("resourceVersion", "generation", "managedFields"):
            new["metadata"].pop(f, None)
        strip = {k: v for k, v in old.items()}
        strip["metadata"] = {
            k: v
            for k, v in old["metadata"].items()
            if k not in ("resourceVersion", "generation", "managedFields")
        }
        changed = strip != new
        gen = old["metadata"].get("generation", 1)
        if {k: v for k, v in old.items() if k not in ("metadata", "status")} != {
            k: v for k, v in new.items() if k not in ("metadata", "status")
        }:
            gen += 1
        new["metadata"]["generation"] = gen
        new["metadata"]["resourceVersion"] = (
            str(next(self._rv)) if changed else old["metadata"]["resourceVersion"]
        )
        return changed

    async def _store(
        self, res: references.resource, ns: str | None, name: str, obj: dict[str, Any], event: str
    ) -> dict[str, Any]:
        key = (res, ns, name)
        if key in self._objects:
            self._objects[key].create(obj)
        else:
            self._objects[key] = obj
        await self._publish(res, ns, event, obj)
        owners = {ref.get("uid") for ref in obj["metadata"].get("ownerReferences") or []}
        if event == "ADDED" and owners and not self._any_live(owners):
            # The garbage collector deletes a dependent whose owners are all gone, e.g. one
            # created by a request that was still in flight when its owner was deleted.
            asyncio.get_running_loop().create_task(self._collect_orphan(res, ns, name))
        return copy.deepcopy(obj)

    def _any_live(self, uids: set[str | None]) -> bool:
        return any(
            not o.deleted and o.raw["metadata"].get("uid") in uids for o in self._objects.values()
        )

    async def _collect_orphan(self, res: references.resource, ns: str | None, name: str) -> None:
        try:
            await self._delete(res, ns, name)
        except kmock.KubernetesObjectNotFoundError:
            pass

    async def _publish(
        self, res: references.resource, ns: str | None, event: str, obj: dict[str, Any]
    ) -> None:
        rv = int(obj["metadata"]["resourceVersion"])
        self.events_log.append((rv, res, ns, {"type": event, "object": copy.deepcopy(obj)}))
        async with self._changed:
            self._changed.notify_all()

    async def _watch(
        self, request: kmock.Request, res: references.resource
    ) -> aiohttp.web.StreamResponse:
        """A watch like the API server's: from ``resourceVersion`` on (no replays,
        no gaps), or the current objects as ADDED first when none is given."""
        resp = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request._raw_request)
        ns = request.namespace
        since = request.params.get("resourceVersion")
        if since:
            pos = 0
            floor = int(since)
        else:
            pos = len(self.events_log)
            floor = 0
            for (r, n, _), o in list(self._objects.items()):
                if r == res and not o.deleted and (ns is None or n == ns):
                    await resp.write(
                        json.dumps({"type": "ADDED", "object": o.raw}).encode() + b"\n"
                    )
        timeout = float(request.params.get("timeoutSeconds") or 3600)
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            while asyncio.get_running_loop().time() < deadline:
                while pos < len(self.events_log):
                    rv, r, n, event = self.events_log[pos]
                    pos += 1
                    if rv > floor and r == res and (ns is None or n == ns):
                        await resp.write(json.dumps(event).encode() + b"\n")
                async with self._changed:
                    try:
                        await asyncio.wait_for(
                            self._changed.wait(),
                            max(0.0, deadline - asyncio.get_running_loop().time()),
                        )
                    except TimeoutError:
                        pass
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        return resp

    async def _delete(self, res: references.resource, ns: str | None, name: str) -> dict[str, Any]:
        key = (res, ns, name)
        if key not in self._objects or self._objects[key].deleted:
            raise kmock.KubernetesObjectNotFoundError()
        obj = copy.deepcopy(self._objects[key].raw)
        if obj["metadata"].get("finalizers"):
            if not obj["metadata"].get("deletionTimestamp"):
                obj["metadata"]["deletionTimestamp"] = NOW()
                obj["metadata"]["resourceVersion"] = str(next(self._rv))
                await self._store(res, ns, name, obj, "MODIFIED")
            return obj
        self._objects[key].delete()
        obj["metadata"]["resourceVersion"] = str(next(self._rv))
        await self._publish(res, ns, "DELETED", obj)
        # Garbage collection: dependents go with their owner (foreground-ish, recursive).
        uid = obj["metadata"].get("uid")
        for (r, n, nm), o in list(self._objects.items()):
            if not o.deleted and any(
                ref.get("uid") == uid for ref in o.raw["metadata"].get("ownerReferences", [])
            ):
                await self._delete(r, n, nm)
        return obj

    def _scale_of(self, obj: dict[str, Any]) -> dict[str, Any]:
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {
                k: obj["metadata"][k]
                for k in ("name", "namespace", "uid", "resourceVersion")
                if k in obj["metadata"]
            },
            "spec": {"replicas": (obj.get("spec") or {}).get("replicas", 0)},
            "status": {
                "replicas": (obj.get("status") or {}).get("replicas", 0),
                "selector": (obj.get("status") or {}).get("selector", ""),
            },
        }

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        res = request.resource
        if res is None or res.plural is None:
            return await kmock.RawHandler._handle(self, request)  # discovery: kmock's own
        if request.action == enums.action.WATCH:
            return await self._watch(request, res)
        for fault in self.faults:
            if (
                fault.times > 0
                and fault.method == str(getattr(request.method, "value", request.method)).upper()
                and fault.path_re.search(request.url.path)
            ):
                fault.times -= 1
                return await self._render_error(
                    kmock.KubernetesError(
                        status=fault.status, reason="Injected", message="injected fault"
                    )
                )
        try:
            async with self._lock:
                payload, status = await self._serve(request, res)
        except kmock.KubernetesError as exc:
            return await self._render_error(exc)
        return aiohttp.web.json_response(payload, status=status)

    async def _serve(self, request: kmock.Request, res: references.resource) -> tuple[Any, int]:
        info = self._info(res)
        if info is None:
            raise kmock.KubernetesResourceNotFoundError()
        method = str(getattr(request.method, "value", request.method)).upper()
        ns, name, sub = request.namespace, request.name, request.subresource
        key = (res, ns, name)
        exists = name is not None and key in self._objects and not self._objects[key].deleted
        current = copy.deepcopy(self._objects[key].raw) if exists else None
        ctype = request.headers.get("Content-Type", "").split(";")[0].strip()

        if method == "GET" and name is None:
            selector = request.params.get("labelSelector", "")
            items = [
                copy.deepcopy(o.raw)
                for (r, n, _), o in self._objects.items()
                if r == res
                and not o.deleted
                and (ns is None or n == ns)
                and _match_selector((o.raw.get("metadata") or {}).get("labels") or {}, selector)
            ]
            return {
                "apiVersion": f"{res.group}/{res.version}".lstrip("/"),
                "kind": f"{info.kind}List",
                "metadata": {"resourceVersion": str(next(self._rv))},
                "items": items,
            }, 200
        if method == "GET":
            if current is None:
                raise kmock.KubernetesObjectNotFoundError()
            return (self._scale_of(current) if sub == "scale" else current), 200
        if method == "POST":
            obj = copy.deepcopy(request.data or json.loads(request.text))
            obj.setdefault("metadata", {})
            if ns is not None:
                obj["metadata"]["namespace"] = ns
            if "generateName" in obj["metadata"] and "name" not in obj["metadata"]:
                obj["metadata"]["name"] = obj["metadata"]["generateName"] + uuid.uuid4().hex[:5]
            nkey = (res, obj["metadata"].get("namespace"), obj["metadata"]["name"])
            if nkey in self._objects and not self._objects[nkey].deleted:
                raise kmock.KubernetesError(
                    status=409, reason="AlreadyExists", message="already exists"
                )
            self._init_meta(obj)
            return await self._store(res, *nkey[1:], obj, "ADDED"), 201
        if method == "DELETE":
            return await self._delete(res, ns, name), 200
        if method not in ("PATCH", "PUT"):
            raise kmock.KubernetesError(status=405, reason="MethodNotAllowed", message=method)

        body: Any = (
            yaml.safe_load(request.text)
            if ctype == "application/apply-patch+yaml"
            else json.loads(request.text)
        )
        if current is None and ctype != "application/apply-patch+yaml":
            raise kmock.KubernetesObjectNotFoundError()
        has_status = "status" in info.subresources
        if sub == "scale":
            replicas = body.get("spec", {}).get("replicas") if isinstance(body, dict) else None
            if ctype == "application/json-patch+json":
                replicas = jsonpatch.apply_patch(self._scale_of(current), body)["spec"]["replicas"]
            new = copy.deepcopy(current)
            new.setdefault("spec", {})["replicas"] = replicas
        elif ctype == "application/apply-patch+yaml":
            if current is None:
                new = copy.deepcopy(body)
                new.setdefault("metadata", {})["namespace"] = ns
                if has_status:
                    new.pop("status", None)
                self._init_meta(new)
                return await self._store(res, ns, name, new, "ADDED"), 201
            new = copy.deepcopy(current)
            for k, v in body.items():
                if k == "metadata":
                    for mk in ("labels", "annotations", "ownerReferences"):
                        if mk in v:
                            new["metadata"][mk] = copy.deepcopy(v[mk])
                elif k == "status" and has_status and sub != "status":
                    continue
                elif k == "spec" and isinstance(v, dict) and isinstance(current.get("spec"), dict):
                    spec = copy.deepcopy(v)
                    if "replicas" in current["spec"] and "replicas" not in spec:
                        spec["replicas"] = current["spec"]["replicas"]  # owned by another manager
                    new["spec"] = spec
                else:
                    new[k] = copy.deepcopy(v)
        elif ctype == "application/json-patch+json":
            try:
                new = jsonpatch.apply_patch(current, body)
            except (jsonpatch.JsonPatchTestFailed, jsonpatch.JsonPatchConflict) as exc:
                raise kmock.KubernetesError(status=422, reason="Invalid", message=str(exc))
        elif method == "PUT":
            new = copy.deepcopy(body)
        else:  # merge-patch / strategic-merge (treated as merge)
            new = _merge(current, body)
        if has_status:  # the status subresource splits writes: main vs status
            if sub == "status":
                new = {**current, "status": new.get("status")}
                if new["status"] is None:
                    new.pop("status")
            else:
                new["status"] = current.get("status")
                if new["status"] is None:
                    new.pop("status")
        new["metadata"] = {**new.get("metadata", {})}
        for f in ("uid", "creationTimestamp", "namespace", "name", "deletionTimestamp"):
            if f in current["metadata"]:
                new["metadata"][f] = current["metadata"][f]
        if not self._bump(current, new):
            return (self._scale_of(current) if sub == "scale" else current), 200
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            await self._store(res, ns, name, new, "MODIFIED")
            await self._delete(res, ns, name)
            return new, 200
        stored = await self._store(res, ns, name, new, "MODIFIED")
        return (self._scale_of(stored) if sub == "scale" else stored), 200
