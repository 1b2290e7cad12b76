"""The operator's Kubernetes API client, on the official ``kubernetes`` Python client:
server-side apply with a fixed field manager, reads, merge patches, the ``status`` and
``scale`` subresources, deletes.

Requests go through the library's :class:`kubernetes.dynamic.DynamicClient`, which finds
each kind's URL by API discovery (``/api``, ``/apis``; kept in memory per client, never in a
file). That client is synchronous, so every call runs in a small thread pool of its own and
the kopf event loop never blocks on the network. Credentials are kopf's (a
``kopf.ConnectionInfo``: in-cluster service account, kubeconfig, tokens, client
certificates), turned into a ``kubernetes.client.Configuration``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import urllib3
from kubernetes import client as k8s_client
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.discovery import LazyDiscoverer
from kubernetes.dynamic.exceptions import ResourceNotFoundError, ResourceNotUniqueError

from kvmesh.operator import crd
from kvmesh.operator.render import FIELD_MANAGER

# kind -> (API prefix, plural). Exactly the resources the operator touches (RBAC lists the same).
RESOURCES: dict[str, tuple[str, str]] = {
    "Deployment": ("/apis/apps/v1", "deployments"),
    "Service": ("/api/v1", "services"),
    "Secret": ("/api/v1", "secrets"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "Pod": ("/api/v1", "pods"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "PersistentVolumeClaim": ("/api/v1", "persistentvolumeclaims"),
    "Job": ("/apis/batch/v1", "jobs"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    crd.KIND: (f"/apis/{crd.GROUP}/{crd.VERSION}", crd.PLURAL),
}

MERGE_PATCH = "application/merge-patch+json"
USER_AGENT = (
    FIELD_MANAGER  # "kvmesh-operator": the tests tell the operator's requests by this prefix
)


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
    proxy_url: str | None = None  # kubeconfig's proxy-url
    trust_env: bool = False  # kopf's settings.networking.trust_env: HTTPS_PROXY/NO_PROXY apply

    @classmethod
    def from_kopf(cls, info: Any) -> Connection:
        return cls(
            server=info.server,
            token=info.token,
            ca_path=info.ca_path,
            ca_data=info.ca_data,
            insecure=bool(info.insecure),
            certificate_path=info.certificate_path,
            private_key_path=info.private_key_path,
            certificate_data=info.certificate_data,
            private_key_data=info.private_key_data,
            proxy_url=getattr(info, "proxy_url", None),
            trust_env=bool(getattr(info, "trust_env", False)),
        )

    def configuration(self) -> tuple[k8s_client.Configuration, list[str]]:
        """The ``kubernetes`` client's configuration for this connection, and the temporary
        PEM files it reads (inline CA/certificate/key data; the caller removes them)."""
        cfg = k8s_client.Configuration()
        cfg.host = self.server.rstrip("/")
        if self.token:
            cfg.api_key = {"authorization": self.token}
            cfg.api_key_prefix = {"authorization": "Bearer"}
        cfg.verify_ssl = not self.insecure
        temp: list[str] = []

        def pem(path: str | None, data: bytes | str | None) -> str | None:
            if path or not data:
                return path
            temp.append(_tempfile(data))
            return temp[-1]

        cfg.ssl_ca_cert = pem(self.ca_path, self.ca_data)
        if (self.certificate_path or self.certificate_data) and (
            self.private_key_path or self.private_key_data
        ):
            cfg.cert_file = pem(self.certificate_path, self.certificate_data)
            cfg.key_file = pem(self.private_key_path, self.private_key_data)
        cfg.retries = False  # KubeClient retries with backoff itself
        if self.proxy_url or not self.trust_env:
            cfg.proxy = self.proxy_url  # as kopf: the environment's proxies only with trust_env
        return cfg, temp


def _tempfile(data: bytes | str) -> str:
    f = tempfile.NamedTemporaryFile(delete=False, suffix=".pem", prefix="kvmesh-")
    f.write(data if isinstance(data, bytes) else data.encode())
    f.close()
    return f.name


def object_path(
    kind: str, namespace: str | None, name: str | None = None, subresource: str | None = None
) -> str:
    prefix, plural = RESOURCES[kind]
    path = f"{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{prefix}/{plural}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


def _plain(_client: Any, data: Any) -> Any:
    """Serializer for DynamicClient calls: the decoded JSON as is (no ResourceInstance)."""
    return data


class _MemoryDiscoverer(LazyDiscoverer):
    """The library's lazy discovery, cached in memory only: its default writes the cache
    to a file under /tmp keyed by the server address, which another cluster (or test
    emulator) on the same address would read back as its own."""

    def __init__(self, client: Any, cache_file: Any = None) -> None:
        # A path that can never exist (/dev/null is no directory): start with a fresh cache.
        super().__init__(client, os.path.join(os.devnull, "kvmesh-discovery.json"))

    def _write_cache(self) -> None:
        pass


class _DynamicClient(DynamicClient):
    """DynamicClient whose every request (discovery included) has a timeout."""

    def __init__(self, api_client: k8s_client.ApiClient, timeout: float) -> None:
        self.request_timeout = timeout
        super().__init__(api_client, discoverer=_MemoryDiscoverer)

    def request(self, method: str, path: str, body: Any = None, **params: Any) -> Any:
        params.setdefault("_request_timeout", self.request_timeout)
        return super().request(method, path, body=body, **params)


def _error(exc: BaseException) -> ApiError:
    """The library's exceptions as ApiError (connection trouble: a transient 503)."""
    if isinstance(exc, ApiException) and exc.status:
        body = exc.body.decode(errors="replace") if isinstance(exc.body, bytes) else exc.body
        message = body or exc.reason or ""
        try:
            message = json.loads(body).get("message") or message
        except (TypeError, ValueError, AttributeError):
            pass
        return ApiError(int(exc.status), str(message))
    if isinstance(exc, ApiException):  # status 0: TLS trouble, as the library reports it
        return ApiError(503, f"connection error: {exc.reason}")
    if isinstance(exc, (ResourceNotFoundError, ResourceNotUniqueError)):
        return ApiError(404, f"not served by the API server: {exc}")
    return ApiError(503, f"connection error: {exc!r}")


class KubeClient:
    """The operator's API client. Every call is retried on transient errors
    (5xx, 429, 409, connection trouble) with exponential backoff."""

    def __init__(
        self,
        conn: Connection,
        *,
        retries: int = 4,
        backoff: float = 0.2,
        timeout: float = 30.0,
        workers: int = 8,
    ) -> None:
        self.conn = conn
        self.retries = retries
        self.backoff = backoff
        self.timeout = timeout
        self.workers = workers
        self._lock = threading.Lock()  # discovery and set-up (the library's are not thread-safe)
        self._dynamic: _DynamicClient | None = None
        self._api_client: k8s_client.ApiClient | None = None
        self._resources: dict[str, Any] = {}  # kind -> discovered kubernetes.dynamic.Resource
        self._temp_files: list[str] = []
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    # -- plumbing ---------------------------------------------------------------
    def _client(self) -> _DynamicClient:
        """The DynamicClient, created (with its first discovery) on first use, in a worker thread."""
        with self._lock:
            if self._dynamic is None:
                if self._api_client is None:
                    cfg, self._temp_files = self.conn.configuration()
                    self._api_client = k8s_client.ApiClient(cfg)
                    self._api_client.user_agent = USER_AGENT
                self._dynamic = _DynamicClient(self._api_client, self.timeout)
            return self._dynamic

    def _resource(self, kind: str, subresource: str | None = None) -> Any:
        """The discovered resource of ``kind`` (cached), or one of its subresources."""
        dyn = self._client()
        with self._lock:
            res = self._resources.get(kind)
            if res is None:
                prefix, _ = RESOURCES[kind]
                parts = prefix.strip("/").split("/")  # ["api", "v1"] or ["apis", group, version]
                if parts[0] == "api":
                    res = dyn.resources.get(prefix="api", api_version=parts[1], kind=kind)
                else:
                    res = dyn.resources.get(
                        prefix="apis", group=parts[1], api_version=parts[2], kind=kind
                    )
                self._resources[kind] = res
        if subresource is None:
            return res
        sub = res.subresources.get(subresource)
        if sub is None:
            raise ApiError(404, f"{kind} has no {subresource} subresource on this API server")
        return sub

    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                self.workers, thread_name_prefix="kvmesh-kube"
            )
        return self._executor

    def _sync(self, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except ApiError:
            raise
        except (
            ApiException,
            ResourceNotFoundError,
            ResourceNotUniqueError,
            urllib3.exceptions.HTTPError,
            OSError,
        ) as exc:
            raise _error(exc) from None

    async def _call(self, call: Callable[[], Any], *, retry_conflicts: bool = True) -> Any:
        delay = self.backoff
        loop = asyncio.get_running_loop()
        for attempt in range(self.retries + 1):
            try:
                return await loop.run_in_executor(self._pool(), self._sync, call)
            except ApiError as exc:
                error = exc
            if (
                not error.transient
                or attempt == self.retries
                or (error.status == 409 and not retry_conflicts)
            ):
                raise error
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)
        raise AssertionError("unreachable")

    async def close(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
            api_client, self._api_client, self._dynamic = self._api_client, None, None
            self._resources.clear()
            temp, self._temp_files = self._temp_files, []
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        if api_client is not None:
            api_client.rest_client.pool_manager.clear()
        for path in temp:
            try:
                os.unlink(path)
            except OSError:
                pass

    # -- the API ----------------------------------------------------------------
    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        content_type: str | None = None,
        params: dict[str, str] | None = None,
        retry_conflicts: bool = True,
    ) -> Any:
        """A raw request to an API path (prefer the named methods below)."""

        def call() -> Any:
            extra = {"content_type": content_type or "application/json"} if body is not None else {}
            result = self._client().request(
                method.upper(),
                path,
                body=body,
                serializer=_plain,
                query_params=list((params or {}).items()),
                **extra,
            )
            return result if result != "" else None

        return await self._call(call, retry_conflicts=retry_conflicts)

    async def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            return await self._call(
                lambda: self._client().get(
                    self._resource(kind), name=name, namespace=namespace, serializer=_plain
                )
            )
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(
        self, kind: str, namespace: str | None, label_selector: str | None = None
    ) -> list[dict]:
        result = await self._call(
            lambda: self._client().get(
                self._resource(kind),
                namespace=namespace,
                label_selector=label_selector or None,
                serializer=_plain,
            )
        )
        return list((result or {}).get("items") or [])

    async def apply(self, obj: dict[str, Any], *, force: bool = True) -> dict[str, Any]:
        """Server-side apply (idempotent). With ``force`` the operator takes the fields it
        renders from any other manager (drift is healed); without it, a field another manager
        owns raises :class:`ApplyConflict` and nothing is changed."""
        meta = obj["metadata"]

        def call() -> Any:
            return self._client().server_side_apply(
                self._resource(obj["kind"]),
                body=obj,
                name=meta["name"],
                namespace=meta.get("namespace"),
                field_manager=FIELD_MANAGER,
                force_conflicts=force,
                serializer=_plain,
            )

        try:
            return await self._call(call, retry_conflicts=force)
        except ApiError as exc:
            if exc.status == 409 and not force:
                raise ApplyConflict(exc.status, exc.message) from None
            raise

    async def delete(self, kind: str, namespace: str | None, name: str) -> None:
        """Delete (background propagation: the garbage collector removes dependents); gone is fine."""
        try:
            await self._call(
                lambda: self._client().delete(
                    self._resource(kind), name=name, namespace=namespace, serializer=_plain
                )
            )
        except ApiError as exc:
            if exc.status != 404:
                raise

    async def patch(
        self, kind: str, namespace: str | None, name: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        """JSON merge patch of the main resource (e.g. annotations)."""
        return await self._call(
            lambda: self._client().patch(
                self._resource(kind),
                body=body,
                name=name,
                namespace=namespace,
                content_type=MERGE_PATCH,
                serializer=_plain,
            )
        )

    async def patch_status(
        self, kind: str, namespace: str, name: str, status: dict[str, Any]
    ) -> dict[str, Any]:
        """JSON merge patch of the ``status`` subresource."""
        return await self._call(
            lambda: self._client().patch(
                self._resource(kind, "status"),
                body={"status": status},
                name=name,
                namespace=namespace,
                content_type=MERGE_PATCH,
                serializer=_plain,
            )
        )

    async def scale(self, kind: str, namespace: str, name: str, replicas: int) -> dict[str, Any]:
        """Set ``spec.replicas`` through the ``scale`` subresource (as an HPA does)."""
        return await self._call(
            lambda: self._client().patch(
                self._resource(kind, "scale"),
                body={"spec": {"replicas": replicas}},
                name=name,
                namespace=namespace,
                content_type=MERGE_PATCH,
                serializer=_plain,
            )
        )
