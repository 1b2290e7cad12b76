"""The operator's real-API-server fixtures: the control plane itself (etcd, kube-apiserver,
kube-controller-manager) lives in kvmesh_testing.controlplane, shared with the local cluster;
this module adds what only the operator's suites use (log capture, the operator in a thread).
See docs/operator.md, "Testing against a real API server", for how to get the binaries.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from kvmesh_testing.controlplane import (  # noqa: F401 - re-exported for the operator's suites
    ADMIN_USER,
    ASSETS_ENV,
    DEFAULT_ASSETS_ROOT,
    KINDS,
    Assets,
    ControlPlane,
    Proc,
    find_assets,
    find_environment,
    make_pki,
    path,
    register_kind,
    wait_for,
)


class LogCapture(logging.Handler):
    """Records of the given loggers (kopf's, the operator's), to look for API errors."""

    def __init__(self, *names: str) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self._lock2 = threading.Lock()
        self.names = names

    def emit(self, record: logging.LogRecord) -> None:
        with self._lock2:
            self.records.append(record)

    def messages(self, level: int = logging.WARNING) -> list[str]:
        with self._lock2:
            return [
                f"{r.name} {r.levelname}: {r.getMessage()}"
                for r in self.records
                if r.levelno >= level
            ]

    def __enter__(self) -> LogCapture:
        for name in self.names:
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name in self.names:
            logging.getLogger(name).removeHandler(self)


class OperatorThread:
    """The real operator (kvmesh.operator.cli.run_operator: kopf, its own event loop in a
    thread, as kopf.testing.KopfRunner does) against ``connection``, cluster-wide."""

    def __init__(self, config: Any, namespaces: list[str] | None = None) -> None:
        self.config, self.namespaces = config, namespaces
        self.thread: threading.Thread | None = None
        self.stop_flag = threading.Event()
        self.error: BaseException | None = None

    def start(self, timeout: float = 30.0) -> None:
        import asyncio

        from kvmesh.operator.cli import run_operator

        ready = threading.Event()

        def main() -> None:
            try:
                asyncio.run(
                    run_operator(
                        self.config,
                        namespaces=self.namespaces,
                        stop_flag=self.stop_flag,
                        ready_flag=ready,
                    )
                )
            except BaseException as exc:  # surfaced by start()/stop()
                self.error = exc

        self.thread = threading.Thread(target=main, name="kopf-operator", daemon=True)
        self.thread.start()
        wait_for(
            lambda: ready.is_set() or self.error is not None,
            timeout=timeout,
            message="operator ready",
        )
        if self.error is not None:
            raise self.error

    def stop(self, timeout: float = 30.0) -> None:
        if self.thread is None:
            return
        self.stop_flag.set()
        self.thread.join(timeout)
        alive = self.thread.is_alive()
        self.thread = None
        assert not alive, "the operator did not stop"
        if self.error is not None:
            raise self.error
