"""The router's Prometheus metrics (its own registry, served on /metrics).

Label values come from fixed sets only (route templates, status codes the router knows, pod
names it routes to, reasons it names), so no client can grow /metrics by sending junk.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LAT_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
)
WAIT_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)

# The `route` label: these templates, anything else is "other".
ROUTES = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/v1/embeddings",
        "/tokenize",
        "/detokenize",
        "/health",
        "/ready",
        "/metrics",
    }
)
# The `status` label: these codes as they are, any other as its class ("2xx" ... "5xx").
STATUSES = frozenset(
    {200, 400, 401, 403, 404, 405, 408, 409, 413, 422, 429, 499, 500, 501, 502, 503, 504}
)


def route_label(path: str) -> str:
    return path if path in ROUTES else "other"


def status_label(status: int) -> str:
    if status in STATUSES:
        return str(status)
    return f"{status // 100}xx" if 100 <= status < 600 else "other"


ERR_BUCKETS = (-4096, -1024, -256, -64, -16, -1, 0, 1, 16, 64, 256, 1024, 4096)


class RouterMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvmesh_router_requests",
            "Requests by route and status",
            ["route", "status"],
            registry=r,
        )
        self.decisions = Counter(
            "kvmesh_router_decisions",
            "Routing decisions by policy and reason",
            ["policy", "reason"],
            registry=r,
        )
        self.routed = Counter(
            "kvmesh_router_routed", "Requests sent to each pod", ["pod"], registry=r
        )
        self.prompt_tokens = Counter(
            "kvmesh_router_prompt_tokens", "Prompt tokens routed", registry=r
        )
        # by LoRA adapter: "" the base model, "other" an adapter no replica lists (router/adapters.py)
        self.predicted_cached = Counter(
            "kvmesh_router_predicted_cached_tokens",
            "Prefix tokens the router predicted cached on the chosen pod",
            ["adapter"],
            registry=r,
        )
        self.engine_cached = Counter(
            "kvmesh_router_engine_cached_tokens",
            "usage.prompt_tokens_details.cached_tokens reported by the engines",
            ["adapter"],
            registry=r,
        )
        # by KV tier (kvmesh/common/kv_tiers.py MEDIA: the only label values)
        self.predicted_cached_by_medium = Counter(
            "kvmesh_router_predicted_cached_tokens_by_medium",
            "Prefix tokens the router predicted cached on the chosen pod, by the tier holding them",
            ["medium"],
            registry=r,
        )
        self.engine_cached_by_medium = Counter(
            "kvmesh_router_engine_cached_tokens_by_medium",
            "usage.prompt_tokens_details.cached_tokens_by_medium reported by the engines",
            ["medium"],
            registry=r,
        )
        self.prediction_error = Histogram(
            "kvmesh_router_prediction_error_tokens",
            "Predicted minus engine-reported cached tokens",
            ["adapter"],
            buckets=ERR_BUCKETS,
            registry=r,
        )
        self.overhead = Histogram(
            "kvmesh_router_overhead_seconds",
            "Router time from request received to upstream request sent",
            buckets=LAT_BUCKETS,
            registry=r,
        )
        self.ttfb = Histogram(
            "kvmesh_router_upstream_ttfb_seconds",
            "Upstream time to response headers",
            buckets=LAT_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "kvmesh_router_request_duration_seconds",
            "Whole request through the router",
            buckets=LAT_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "kvmesh_router_retries", "Retries on another pod", ["reason"], registry=r
        )
        self.ejections = Counter(
            "kvmesh_router_ejections", "Pods ejected by the circuit breaker", ["pod"], registry=r
        )
        self.redis_errors = Counter(
            "kvmesh_router_redis_errors", "Redis operations that failed", ["op"], registry=r
        )
        self.rate_limited = Counter(
            "kvmesh_router_rate_limited", "Requests refused with 429", ["limit"], registry=r
        )
        self.auth_failures = Counter(
            "kvmesh_router_auth_failures", "Requests refused with 401", registry=r
        )
        self.client_disconnects = Counter(
            "kvmesh_router_client_disconnects",
            "Client disconnects that cancelled the upstream request",
            registry=r,
        )
        self.pods = Gauge(
            "kvmesh_router_pods", "Pods known to the router by state", ["state"], registry=r
        )
        self.redis_up = Gauge(
            "kvmesh_router_redis_up", "1 if the last Redis operation succeeded", registry=r
        )
        self.upstream_failures = Counter(
            "kvmesh_router_upstream_failures",
            "Engine failures by phase: connect (not sent, retried), before_response "
            "(sent, no answer: 502), body (502), mid_stream (SSE error event)",
            ["phase"],
            registry=r,
        )
        self.internal_errors = Counter(
            "kvmesh_router_internal_errors",
            "Unexpected exceptions caught at the ASGI boundary",
            registry=r,
        )
        self.tokenize = Histogram(
            "kvmesh_router_tokenize_seconds",
            "Prompt tokenization and block keys",
            buckets=LAT_BUCKETS,
            registry=r,
        )
        # streams that survive their replica (router/resume.py)
        self.resumed = Counter(
            "kvmesh_router_resumed_requests",
            "Requests sent on to another replica after their engine failed, by where it failed: "
            "mid_stream, before_response (sent, no answer), body",
            ["phase"],
            registry=r,
        )
        self.resume_seconds = Histogram(
            "kvmesh_router_resume_seconds",
            "From an engine's failure to the continuation's first event (a stream) or its answer",
            buckets=LAT_BUCKETS,
            registry=r,
        )
        self.resumed_tokens = Counter(
            "kvmesh_router_resumed_tokens",
            "Tokens continuations re-prefill: the prompt and the ids already generated",
            registry=r,
        )
        self.resume_waiting = Gauge(
            "kvmesh_router_resume_waiting_requests",
            "Requests whose engine failed, waiting for a replica to go on with "
            "(none routable: an engine restarting)",
            registry=r,
        )
        self.resume_given_up = Counter(
            "kvmesh_router_resume_given_up",
            "Engine failures not resumed, by reason: limit, no_replica, refused, "
            "no_token_ids, shutdown, inexact (vLLM could not go on token for token)",
            ["reason"],
            registry=r,
        )
        # scale from zero
        self.held = Gauge(
            "kvmesh_router_held_requests",
            "Requests held because no replica is routable (scale from zero)",
            registry=r,
        )
        self.held_wait = Histogram(
            "kvmesh_router_scale_from_zero_wait_seconds",
            "How long held requests waited, by outcome",
            ["outcome"],
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.held_outcomes = Counter(
            "kvmesh_router_scale_from_zero",
            "Held requests by outcome: dispatched, timeout, queue_full, disconnect, shutdown",
            ["outcome"],
            registry=r,
        )
        self.demand_signals = Counter(
            "kvmesh_router_demand_signals",
            "Writes of the scale-from-zero demand key to Redis",
            registry=r,
        )

        # flow control (router/flow): labels from the configured bands, fixed reasons, and the
        # bounded tenant table (a tenant's series goes when it leaves the table)
        self.flow_queue_depth = Gauge(
            "kvmesh_router_flow_queue_depth",
            "Requests waiting at the router (flow control) by band",
            ["band"],
            registry=r,
        )
        self.flow_queued_seconds = Histogram(
            "kvmesh_router_flow_queued_seconds",
            "How long requests waited at the router (flow control), by band and outcome",
            ["band", "outcome"],
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.flow_dispatched = Counter(
            "kvmesh_router_flow_dispatched",
            "Requests let through by flow control, by band and whether they waited",
            ["band", "queued"],
            registry=r,
        )
        self.flow_shed = Counter(
            "kvmesh_router_flow_shed",
            "Requests refused by flow control, by band and reason: queue_full, shed (room for "
            "a higher band), tenant_share (room for a tenant holding less of the queue), "
            "deadline, shutdown",
            ["band", "reason"],
            registry=r,
        )
        self.flow_saturated = Gauge(
            "kvmesh_router_flow_saturated",
            "1 while every routable replica is saturated (requests wait at the router)",
            registry=r,
        )
        self.flow_tenant_service = Counter(
            "kvmesh_router_flow_tenant_service_tokens",
            "Virtual tokens (weighted prompt + output over the tenant's weight) this router "
            "gave each tenant it tracks (at most --flow-max-tenants; the rest are 'other')",
            ["tenant"],
            registry=r,
        )
        self.flow_tenants = Gauge(
            "kvmesh_router_flow_tenants", "Tenants in the flow-control table", registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
