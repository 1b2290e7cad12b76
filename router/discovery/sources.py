"""Endpoints (the pods the platform lists) and two of their sources: static backends and a backends file."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger("kvmesh.router.discovery")


@dataclass(frozen=True)
class Endpoint:
    """A pod as the platform knows it: `name` is None for an unnamed static backend; `ready`
    is False for an endpoint Kubernetes lists as not ready (starting, failing its readiness
    probe, terminating): known, so its heartbeat is not "unknown", but never routed to."""

    name: str | None
    url: str
    ready: bool = True


def normalize_url(url: str) -> tuple[str, str, int | None, str] | None:
    """(scheme, host, port, path) for comparing URLs; None if it is not an http(s) URL."""
    try:
        u = urlsplit(url.strip())
        port = u.port or (443 if u.scheme == "https" else 80)
    except ValueError:
        return None
    if u.scheme not in ("http", "https") or not u.hostname:
        return None
    return u.scheme, u.hostname.lower(), port, u.path.rstrip("/")


def parse_backend(entry: str) -> Endpoint:
    """`URL` or `NAME=URL` (a static backend, a line of --backends-file)."""
    entry = entry.strip()
    name: str | None = None
    if "=" in entry and "://" not in entry.split("=", 1)[0]:
        name, entry = (x.strip() for x in entry.split("=", 1))
        if not name:
            raise ValueError(f"backend {entry!r}: empty name before '='")
    if normalize_url(entry) is None:
        raise ValueError(f"backend {entry!r} is not an http(s) URL")
    return Endpoint(name, entry.rstrip("/"))


class StaticEndpoints:
    def __init__(self, entries: Iterable[str]):
        self.items = [parse_backend(e) for e in entries if e.strip()]
        names = [e.name for e in self.items if e.name]
        if len(names) != len(set(names)):
            raise ValueError("duplicate backend names in --static-backends")

    def endpoints(self) -> list[Endpoint] | None:
        return self.items

    def describe(self) -> dict[str, Any]:
        return {"kind": "static", "endpoints": len(self.items)}


class FileEndpoints:
    """`NAME=URL` (or `URL`) lines, `#` comments; re-read when the file changes. A file that
    cannot be read or parsed keeps the last good list (and says so in `error`)."""

    def __init__(self, path: str):
        self.path = path
        self._stamp: tuple[float, int] | None = None
        self.items: list[Endpoint] | None = None
        self.error: str | None = None

    def endpoints(self) -> list[Endpoint] | None:
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime, st.st_size)
            if stamp != self._stamp:
                with open(self.path) as f:
                    lines = [ln.split("#", 1)[0].strip() for ln in f]
                self.items = [parse_backend(ln) for ln in lines if ln]
                self._stamp = stamp
                self.error = None
        except (OSError, ValueError) as exc:
            if self.error != str(exc):
                log.warning("--backends-file %s: %s (keeping the last good list)", self.path, exc)
            self.error = str(exc)
        return self.items

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "file",
            "path": self.path,
            "endpoints": len(self.items or []),
            "error": self.error,
        }
