"""Settle a finished request: its metrics, its rate-limit charge against the engine's usage, its access-log line."""

from __future__ import annotations

import logging
import time

from kvmesh.common.kv_tiers import MEDIA, USAGE_BY_MEDIUM
from kvmesh.common.logging_setup import redact_url
from kvmesh.router.auth import RateLimiter
from kvmesh.router.metrics import RouterMetrics, status_label
from kvmesh.router.proxy import Outcome
from kvmesh.router.request_state import Call

access_log = logging.getLogger("kvmesh.router.access")


def settle(
    call: Call, out: Outcome, metrics: RouterMetrics, limiter: RateLimiter, policy: str
) -> None:
    m = metrics
    status = out.status
    dur = time.perf_counter() - call.t0
    m.requests.labels(call.route, status_label(status)).inc()
    m.duration.observe(dur)
    m.prompt_tokens.inc(len(call.tokens))
    cached = None
    if status == 200:
        m.predicted_cached.labels(call.adapter_label).inc(call.predicted)
        for medium, n in call.predicted_by_medium.items():
            m.predicted_cached_by_medium.labels(medium).inc(n)
        usage = out.usage
        if usage:
            details = usage.get("prompt_tokens_details") or {}
            cached = details.get("cached_tokens")
            _engine_by_medium(m, details)
            if isinstance(cached, int):
                m.engine_cached.labels(call.adapter_label).inc(cached)
                m.prediction_error.labels(call.adapter_label).observe(call.predicted - cached)
            real = usage.get("total_tokens")
            if isinstance(real, int) and real >= 0 and call.charged:
                limiter.adjust(call.client_id, real - call.charged, call.tpm)
    elif status >= 400 and status not in (499, 504) and call.charged:
        limiter.adjust(
            call.client_id, -call.charged, call.tpm
        )  # refused, or never reached an engine
    if access_log.isEnabledFor(logging.INFO):
        access_log.info(
            "request",
            extra={
                "fields": {
                    "request_id": call.rid,
                    "route": call.route,
                    "status": status,
                    "pod": redact_url(out.pod),
                    "policy": policy,
                    "reason": call.reason,
                    "attempts": out.attempts,
                    "prompt_tokens": len(call.tokens),
                    "predicted_cached_tokens": call.predicted,
                    "cached_tokens": cached,
                    "stream": bool(call.req.get("stream")),
                    "held_s": round(call.held_s, 3) if call.held_s is not None else None,
                    "error": out.error,
                    "duration_ms": round(dur * 1000, 2),
                    "client": call.client_id,
                    "resumes": call.resumes,
                }
            },
        )


def _engine_by_medium(m: RouterMetrics, details: dict) -> None:
    """The engine's cached tokens by tier (``cached_tokens_by_medium``): known media only, and
    only counts that are non-negative ints (the label's values stay bounded)."""
    by_medium = details.get(USAGE_BY_MEDIUM) if isinstance(details, dict) else None
    if not isinstance(by_medium, dict):
        return
    for medium in MEDIA:
        n = by_medium.get(medium)
        if type(n) is int and n >= 0:
            m.engine_cached_by_medium.labels(medium).inc(n)
