"""How the router answers when an engine fails before the client got anything: one table of failures, one answer function.

Each failure names its `kvmesh_router_upstream_failures_total` stage, the status and error the
client gets, and the Outcome's error (the access log's and the retry logic's word for it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvmesh.common.logging_setup import redact_url

log = logging.getLogger("kvmesh.router")


@dataclass(frozen=True)
class UpstreamFailure:
    stage: str  # the upstream_failures metric's label
    status: int
    message: str  # to the client
    etype: str
    code: str | None
    error: str  # Outcome.error
    log_line: str  # "%s" is the pod, "%s" the exception
    shutdown_first: bool  # while the router's drain is cutting requests, this failure is ours: answer "shutting down"


TIMEOUT = UpstreamFailure(
    "before_response",
    504,
    "upstream engine timed out",
    "timeout_error",
    None,
    "timeout",
    "%s did not answer in time (%r)",
    False,
)
DISCONNECTED = UpstreamFailure(
    "before_response",
    502,
    "the engine closed the connection before answering",
    "upstream_error",
    "upstream_disconnected",
    "disconnected",
    "%s closed the connection before answering: %s",
    False,
)
BODY = UpstreamFailure(
    "body",
    502,
    "the engine failed while sending its answer",
    "upstream_error",
    "upstream_failed",
    "body",
    "%s failed while sending its answer: %s",
    True,
)
FIRST_EVENT = UpstreamFailure(
    "before_response",
    502,
    "the engine failed before its first event",
    "upstream_error",
    "upstream_failed",
    "before_first_event",
    "%s failed before its first event: %s",
    True,
)


def log_failure(failure: UpstreamFailure, pod: str, exc: BaseException, rid: str) -> None:
    log.warning(failure.log_line, redact_url(pod), exc, extra={"fields": {"request_id": rid}})
