"""A small asyncio Kubernetes API client: server-side apply with a fixed field
manager, reads, status patches. Uses the same credentials as kopf (a
``kopf.ConnectionInfo``), so in-cluster service accounts and kubeconfigs both work.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import tempfile
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvmesh.operator import crd
from kvmesh.operator.render import FIELD_MANAGER

# kind -> (API prefix, plural). Exactly the resources the operator touches (RBAC lists the same).
RESOURCES: dict[str, tuple[str, str]] = {
    "Deployment": ("/apis/apps/v1", "deployments"),
    "Service": ("/api/v1", "services"),
    "Secret": ("/api/v1", "secrets"),
    "Pod": ("/api/v1", "pods"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "PersistentVolumeClaim": ("/api/v1", "persistentvolumeclaims"),
    "Job": ("/apis/batch/v1", "jobs"),
    crd.KIND: (f"/apis/{crd.GROUP}/{crd.VERSION}", crd.PLURAL),
}


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message

    @property
    def transient(self) -> bool:
        """Worth retrying: server-side trouble, throttling, conflicts."""
        return self.status >= 500 or self.status in (409, 429)


class ApplyConflict(ApiError):
    """Server-side apply without force met fields another manager owns (HTTP 409). Not
    transient: retrying the same apply conflicts again; the caller decides who wins."""

    @property
    def transient(self) -> bool:
        return False


@dataclass
class Connection:
    """Where the API server is and how to authenticate (a subset of kopf.ConnectionInfo)."""
    server: str
    token: str | None = None
    ca_path: str | None = None
    ca_data: bytes | str | None = None
    insecure: bool = False
    certificate_path: str | None = None
    private_key_path: str | None = None
    certificate_data: bytes | str | None = None
    private_key_data: bytes | str | None = None

    @classmethod
    def from_kopf(cls, info: Any) -> "Connection":
        return cls(server=info.server, token=info.token, ca_path=info.ca_path, ca_data=info.ca_data,
                   insecure=bool(info.insecure), certificate_path=info.certificate_path,
                   private_key_path=info.private_key_path, certificate_data=info.certificate_data,
                   private_key_data=info.private_key_data)

    def ssl_context(self) -> ssl.SSLContext | bool:
        if not self.server.startswith("https"):
            return False
        ctx = ssl.create_default_context(cafile=self.ca_path,
                                         cadata=self.ca_data.decode() if isinstance(self.ca_data, bytes)
                                         else self.ca_data)
        if self.insecure:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        cert, key = self.certificate_path, self.private_key_path
        if self.certificate_data and self.private_key_data:
            cert, key = _tempfile(self.certificate_data), _tempfile(self.private_key_data)
        if cert:
            ctx.load_cert_chain(cert, key)
        return ctx


def _tempfile(data: bytes | str) -> str:
    f = tempfile.NamedTemporaryFile(delete=False, suffix=".pem")
    f.write(data if isinstance(data, bytes) else data.encode())
    f.close()
    return f.name


def object_path(kind: str, namespace: str | None, name: str | None = None, subresource: str | None = None) -> str:
    prefix, plural = RESOURCES[kind]
    path = f"{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{prefix}/{plural}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


class KubeClient:
    """The operator's API client. Every call is retried on transient errors
    (5xx, 429, 409, connection trouble) with exponential backoff."""

    def __init__(self, conn: Connection, *, retries: int = 4, backoff: float = 0.2,
                 timeout: float = 30.0) -> None:
        self.conn = conn
        self.retries = retries
        self.backoff = backoff
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    async def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Accept": "application/json", "User-Agent": FIELD_MANAGER}
            if self.conn.token:
                headers["Authorization"] = f"Bearer {self.conn.token}"
            self._session = aiohttp.ClientSession(
                headers=headers,
                connector=aiohttp.TCPConnector(ssl=self.conn.ssl_context()),
                timeout=aiohttp.ClientTimeout(total=self.timeout))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def request(self, method: str, path: str, *, body: Any = None, content_type: str | None = None,
                      params: dict[str, str] | None = None, retry_conflicts: bool = True) -> Any:
        session = await self._sess()
        url = self.conn.server.rstrip("/") + path
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type or "application/json"} if data is not None else {}
        delay = self.backoff
        for attempt in range(self.retries + 1):
            try:
                async with session.request(method, url, data=data, headers=headers, params=params) as resp:
                    text = await resp.text()
                    if resp.status < 400:
                        return json.loads(text) if text else None
                    try:
                        message = json.loads(text).get("message", text)
                    except ValueError:
                        message = text
                    error = ApiError(resp.status, message)
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                error = ApiError(503, f"connection error: {exc!r}")
            if not error.transient or attempt == self.retries or (error.status == 409 and not retry_conflicts):
                raise error
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)
        raise AssertionError("unreachable")

    async def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", object_path(kind, namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, kind: str, namespace: str | None, label_selector: str | None = None) -> list[dict]:
        params = {"labelSelector": label_selector} if label_selector else None
        result = await self.request("GET", object_path(kind, namespace), params=params)
        return list((result or {}).get("items") or [])

    async def apply(self, obj: dict[str, Any], *, force: bool = True) -> dict[str, Any]:
        """Server-side apply (idempotent). With ``force`` the operator takes the fields it
        renders from any other manager (drift is healed); without it, a field another manager
        owns raises :class:`ApplyConflict` and nothing is changed."""
        meta = obj["metadata"]
        path = object_path(obj["kind"], meta.get("namespace"), meta["name"])
        params = {"fieldManager": FIELD_MANAGER, "force": "true" if force else "false"}
        try:
            return await self.request("PATCH", path, body=obj, content_type="application/apply-patch+yaml",
                                      params=params, retry_conflicts=force)
        except ApiError as exc:
            if exc.status == 409 and not force:
                raise ApplyConflict(exc.status, exc.message) from None
            raise

    async def delete(self, kind: str, namespace: str | None, name: str) -> None:
        """Delete (background propagation: the garbage collector removes dependents); gone is fine."""
        try:
            await self.request("DELETE", object_path(kind, namespace, name))
        except ApiError as exc:
            if exc.status != 404:
                raise

    async def patch(self, kind: str, namespace: str | None, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """JSON merge patch of the main resource (e.g. annotations)."""
        return await self.request("PATCH", object_path(kind, namespace, name), body=body,
                                  content_type="application/merge-patch+json")

    async def patch_status(self, kind: str, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        return await self.request("PATCH", object_path(kind, namespace, name, "status"), body={"status": status},
                                  content_type="application/merge-patch+json")

    async def scale(self, kind: str, namespace: str, name: str, replicas: int) -> dict[str, Any]:
        return await self.request("PATCH", object_path(kind, namespace, name, "scale"),
                                  body={"spec": {"replicas": replicas}},
                                  content_type="application/merge-patch+json")
