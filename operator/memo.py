"""The operator's configuration and the state every handler shares through kopf's ``memo``."""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvmesh.operator import render
from kvmesh.operator.apply import Connection, KubeClient


@dataclass
class OperatorConfig:
    images: render.Images = field(default_factory=render.Images)
    connection: Connection | None = None  # None: in-cluster service account, else kubeconfig
    status_interval: float = 10.0  # status refresh when not autoscaling
    managed_redis_url: str | None = None  # reach managed Redis here instead of its in-cluster
    # Service name (operator outside the cluster, tests)
    clock: Callable[[], float] = time.time  # the autoscaler's clock (tests fast-forward it)
    api_retries: int = 4
    rejected_retry_delay: float = 60.0  # slow retry after the API server rejected a child
    resync_interval: float = 60.0  # full reconcile of every ModelDeployment this often,
    # besides the one a child's change triggers
    heal_debounce: float = 0.2  # gather a burst of child events into one reconcile
    watch_server_timeout: int = 300  # the API server ends a watch after this (whole seconds:
    # timeoutSeconds=300.0 is a 400); kopf re-lists
    watch_client_timeout: float = 330.0  # a watch silent this long is dead: restart it
    watch_connect_timeout: float = 30.0
    adapter_interval: float = (
        10.0  # adapters compared with the heartbeats (and repaired) this often
    )
    adapter_settle_seconds: float = 10.0  # a heartbeat this much newer than a load should show it
    adapter_retry_seconds: float = 30.0  # a failed load is tried again after this
    adapter_load_timeout: float = 120.0  # one load or unload call to an engine


@dataclass
class Shared:
    """Operator-wide mutable state. kopf hands each resource a shallow copy of the memo,
    so anything that must be seen everywhere after startup lives in this one object."""

    client: KubeClient | None = None
    stopping: bool = False
    dirty: dict[tuple[str, str], asyncio.Event] = field(
        default_factory=dict
    )  # (ns, md) -> heal now
    fingerprints: dict[str, str] = field(default_factory=dict)  # child uid -> last seen
    conflicts: dict[str, str] = field(default_factory=dict)  # md uid -> conflict message
    # md uid -> the lock one reconcile holds (the create/update handler and the healer never overlap)
    reconcile_locks: weakref.WeakValueDictionary[str, asyncio.Lock] = field(
        default_factory=weakref.WeakValueDictionary
    )


@dataclass
class Memo:
    config: OperatorConfig = field(default_factory=OperatorConfig)
    shared: Shared = field(default_factory=Shared)
    scalers: dict[str, Any] = field(default_factory=dict)  # uid -> scaling.LoopState
    redis: dict[str, Any] = field(default_factory=dict)  # url -> metrics_source.RedisHeartbeats
    adapters: dict[str, Any] = field(default_factory=dict)  # uid -> adapter_sync.SyncState
    last_actions: dict[str, str] = field(default_factory=dict)

    @property
    def client(self) -> KubeClient | None:
        return self.shared.client

    @property
    def stopping(self) -> bool:
        return self.shared.stopping
