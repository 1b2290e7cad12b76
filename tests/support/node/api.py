"""A small synchronous Kubernetes API client for the node agent and the service forwarder:
a kubeconfig with a bearer token and a CA file (what kvmesh_testing.controlplane writes),
get/list/create/patch/delete of dicts, and watches."""

from __future__ import annotations

import json
import logging
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

log = logging.getLogger(__name__)


class ApiError(RuntimeError):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"{status}: {text[:500]}")
        self.status = status


class Api:
    def __init__(self, kubeconfig: Path, timeout: float = 30.0) -> None:
        cfg = yaml.safe_load(Path(kubeconfig).read_text())
        ctx_name = cfg.get("current-context") or cfg["contexts"][0]["name"]
        ctx = next(c["context"] for c in cfg["contexts"] if c["name"] == ctx_name)
        cluster = next(c["cluster"] for c in cfg["clusters"] if c["name"] == ctx["cluster"])
        user = next(u["user"] for u in cfg["users"] if u["name"] == ctx["user"])
        self.server = cluster["server"]
        self.ca_file = cluster.get("certificate-authority")
        verify: Any = ssl.create_default_context(cafile=self.ca_file) if self.ca_file else True
        headers = {"Accept": "application/json"}
        if user.get("token"):
            headers["Authorization"] = f"Bearer {user['token']}"
        # trust_env=False: never route the cluster's own traffic through a proxy from the environment.
        self.client = httpx.Client(
            base_url=self.server, verify=verify, headers=headers, timeout=timeout, trust_env=False
        )
        self._watch_client = httpx.Client(
            base_url=self.server,
            verify=verify,
            headers=headers,
            timeout=httpx.Timeout(timeout, read=None),
            trust_env=False,
        )

    def close(self) -> None:
        self.client.close()
        self._watch_client.close()

    @staticmethod
    def _check(resp: httpx.Response) -> dict[str, Any]:
        if resp.status_code >= 400:
            raise ApiError(resp.status_code, resp.text)
        return resp.json() if resp.content else {}

    def get(self, path: str, **params: Any) -> dict[str, Any] | None:
        resp = self.client.get(path, params=params or None)
        if resp.status_code == 404:
            return None
        return self._check(resp)

    def list(self, path: str, **params: Any) -> dict[str, Any]:
        return self._check(self.client.get(path, params=params or None))

    def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._check(self.client.post(path, json=body))

    def put(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._check(self.client.put(path, json=body))

    def patch(
        self, path: str, body: dict[str, Any], kind: str = "strategic-merge-patch"
    ) -> dict[str, Any]:
        return self._check(
            self.client.patch(
                path, content=json.dumps(body), headers={"Content-Type": f"application/{kind}+json"}
            )
        )

    def delete(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any] | None:
        resp = self.client.request("DELETE", path, json=body)
        if resp.status_code == 404:
            return None
        return self._check(resp)

    def watch(
        self, path: str, resource_version: str, timeout_seconds: int = 60, **params: Any
    ) -> Iterator[dict[str, Any]]:
        """The events of one watch request (ends when the server closes it)."""
        query = {
            "watch": "1",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout_seconds),
            **params,
        }
        with self._watch_client.stream("GET", path, params=query) as resp:
            if resp.status_code >= 400:
                raise ApiError(resp.status_code, resp.read().decode(errors="replace"))
            for line in resp.iter_lines():
                if line.strip():
                    yield json.loads(line)


class Informer:
    """A list+watch cache of one resource (as client-go's informers keep): ``objects`` by
    namespace/name, ``on_event(type, obj)`` for every change; relists after a watch error."""

    def __init__(self, api: Api, path: str, on_event: Any = None, **params: Any) -> None:
        self.api, self.path, self.params, self.on_event = api, path, params, on_event
        self.objects: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()
        self.synced = threading.Event()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"informer{path}", daemon=True)

    def start(self) -> Informer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()

    @staticmethod
    def key(obj: dict[str, Any]) -> str:
        meta = obj["metadata"]
        return f"{meta.get('namespace', '')}/{meta['name']}"

    def items(self) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.objects.values())

    def _emit(self, kind: str, obj: dict[str, Any]) -> None:
        if self.on_event is not None:
            try:
                self.on_event(kind, obj)
            except Exception:  # a handler's bug must not stop the cache
                log.exception("informer handler for %s failed", self.path)

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                listing = self.api.list(self.path, **self.params)
                fresh = {self.key(o): o for o in listing.get("items") or []}
                with self.lock:
                    gone = [o for k, o in self.objects.items() if k not in fresh]
                    self.objects = fresh
                for obj in gone:
                    self._emit("DELETED", obj)
                for obj in fresh.values():
                    self._emit("MODIFIED", obj)
                self.synced.set()
                rv = listing["metadata"]["resourceVersion"]
                while not self.stopping.is_set():
                    for event in self.api.watch(self.path, rv, timeout_seconds=30, **self.params):
                        obj = event["object"]
                        if event["type"] == "ERROR":
                            raise ApiError(obj.get("code", 500), obj.get("message", ""))
                        rv = obj["metadata"].get("resourceVersion", rv)
                        if event["type"] == "BOOKMARK":
                            continue
                        with self.lock:
                            if event["type"] == "DELETED":
                                self.objects.pop(self.key(obj), None)
                            else:
                                self.objects[self.key(obj)] = obj
                        self._emit(event["type"], obj)
            except (
                Exception
            ) as exc:  # 410 Gone, a dropped connection, the server going away: relist
                if self.stopping.is_set():
                    return
                log.debug("informer %s: %s; relisting", self.path, exc)
                self.stopping.wait(0.5)
