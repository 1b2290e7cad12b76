"""Structured (JSON lines) or text logging for the router, sidecar and `kvmesh up`."""

from __future__ import annotations

import json
import logging
import re
import sys
import time

_URL_PASSWORD = re.compile(r"(://[^:/@]*:)[^@/]*@")


def redact_url(url: str) -> str:
    """redis://user:secret@host -> redis://user:***@host"""
    return _URL_PASSWORD.sub(r"\1***@", url)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(time.time(), 3), "level": record.levelname.lower(), "logger": record.name,
               "msg": record.getMessage()}
        extra = getattr(record, "fields", None)
        if extra:
            out.update(extra)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(fmt: str = "json", level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Every poll of the engine (/ready, /metrics, once a second) would be an INFO line.
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
