"""The one logging setup: structured (JSON lines) or text, URL credentials redacted.

Used by every process kvmesh starts: the router and the sidecar (``--log-format``, env
``KVMESH_LOG_FORMAT``), the engine server and the operator (text), and `kvmesh up`."""

from __future__ import annotations

import json
import logging
import re
import sys
import time

# scheme://USERINFO@host...: the user info is everything up to the LAST "@" before the next
# whitespace or quote (a password may itself hold "@", "/", ":" or "#"), redacted whole.
_URL_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://)[^\s\"'<>]*@")
# secrets passed as query parameters (redis://host/0?password=...)
_URL_QUERY_SECRET = re.compile(
    r"([?&](?:password|passwd|pwd|token|key|secret|api_key)=)[^&\s\"'<>]*", re.IGNORECASE
)


def redact_url(url: str) -> str:
    """Credentials in URLs, wholly: redis://user:p@ss/word@host -> redis://***@host (the user name
    goes too), ?password=x -> ?password=***. Works on any text holding URLs."""
    if "@" in url:
        url = _URL_USERINFO.sub(r"\1***@", url)
    if "=" in url:
        url = _URL_QUERY_SECRET.sub(r"\1***", url)
    return url


class _Redacting(logging.Formatter):
    """Any formatter's output with URL credentials redacted (a log line never holds a password,
    whoever logged the URL)."""

    def __init__(self, inner: logging.Formatter):
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        return redact_url(self.inner.format(record))


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(time.time(), 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        extra = getattr(record, "fields", None)
        if extra:
            out.update(extra)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted, not the one at setup (as
    logging's own last-resort handler): a server started while stderr was redirected (a test's
    capture, a supervisor's pipe swapped out) keeps logging to the real one after it is closed."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


def setup_logging(fmt: str = "json", level: str = "INFO") -> None:
    handler = _CurrentStderr()
    if fmt == "json":
        handler.setFormatter(_Redacting(JsonFormatter()))
    else:
        handler.setFormatter(
            _Redacting(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Every poll of the engine (/ready, /metrics, once a second) would be an INFO line.
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
