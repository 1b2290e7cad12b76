"""`kvmesh router`: the prefix-aware, OpenAI-compatible front door."""

from __future__ import annotations

import argparse
import os

from kvmesh.common.block_keys import DEFAULT_BLOCK_SIZE
from kvmesh.common.chat_prompt import TOOL_PROMPTS
from kvmesh.common.logging_setup import redact_url, setup_logging
from kvmesh.common.model_lookup import DEFAULT_MODEL
from kvmesh.router import policies


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="served model name (block-key identity)")
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer source: built-in model name or HF dir"
    )
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--redis-url",
        default=os.environ.get("KVMESH_REDIS_URL", "redis://127.0.0.1:6379/0"),
        help="'none' with --static-backends for no Redis at all",
    )
    p.add_argument(
        "--static-backends",
        default=None,
        help="URL or NAME=URL, comma-separated: the engines (NAME: the pod name its sidecar heart-beats "
        "under); one endpoint source is required",
    )
    p.add_argument(
        "--backends-file",
        default=None,
        help="endpoint source: a file of NAME=URL lines, re-read when it changes (kvmesh up)",
    )
    p.add_argument("--policy", choices=policies.NAMES, default=policies.DEFAULT)
    p.add_argument(
        "--weights",
        default="prefix=1.0,kv=0.5,queue=0.5",
        help="routing-score weights (contract 4)",
    )
    p.add_argument(
        "--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="must match the engines"
    )
    p.add_argument(
        "--engine",
        choices=["kvmesh", "vllm"],
        default="kvmesh",
        help="the engines' kind: `vllm` reads their readiness from /health and resumes a stream "
        "through vLLM's completions API (docs/vllm.md)",
    )
    p.add_argument(
        "--tool-call-parser",
        default="hermes",
        choices=sorted(TOOL_PROMPTS),
        help="the engines' --tool-call-parser: how they describe tools to a chat template that does "
        "not read them; the router renders tool requests the same way to match their cached prefix",
    )
    p.add_argument(
        "--api-keys-file",
        default=None,
        help="API keys, one per line (env KVMESH_API_KEYS: a path or the keys themselves)",
    )
    # additions beyond the agreed flags
    p.add_argument(
        "--rate-limit-rpm", type=float, default=None, help="default requests/minute per key"
    )
    p.add_argument(
        "--rate-limit-tpm", type=float, default=None, help="default tokens/minute per key"
    )
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    p.add_argument("--max-retries", type=int, default=2)
    p.add_argument(
        "--max-resumes",
        type=int,
        default=2,
        help="times a request whose engine failed after it was sent (mid-stream, or before answering) "
        "goes on with another replica; 0: never (the client gets the error)",
    )
    p.add_argument(
        "--resume-timeout",
        type=float,
        default=60.0,
        help="seconds a request whose engine failed waits for a replica to go on with when none is "
        "routable (a one-replica deployment's engine restarting in place); 0: the error at once",
    )
    p.add_argument("--connect-timeout", type=float, default=2.0)
    p.add_argument(
        "--read-timeout", type=float, default=300.0, help="longest silence from an engine"
    )
    p.add_argument(
        "--request-timeout", type=float, default=None, help="longest whole request (default none)"
    )
    p.add_argument(
        "--eject-after", type=int, default=3, help="consecutive failures that eject a pod"
    )
    p.add_argument("--eject-seconds", type=float, default=10.0)
    p.add_argument("--hotspot-ratio", type=float, default=2.0)
    p.add_argument("--hotspot-min-load", type=int, default=2)
    p.add_argument("--session-header", default="X-Session-Id")
    p.add_argument("--redis-timeout", type=float, default=0.25)
    p.add_argument("--refresh-interval", type=float, default=0.5, help="heartbeat re-read period")
    p.add_argument(
        "--upstream-api-key",
        default=os.environ.get("KVMESH_UPSTREAM_API_KEY"),
        help="key the router presents to engines (env KVMESH_UPSTREAM_API_KEY)",
    )
    p.add_argument(
        "--k8s-service",
        default=None,
        help="endpoint source: the engine Service; routes to the ready endpoints of its EndpointSlices "
        "(list+watch; RBAC get/list/watch on endpointslices.discovery.k8s.io)",
    )
    p.add_argument(
        "--k8s-namespace",
        default=None,
        help="the namespace of `--k8s-service` (default: the pod's)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="also serve /metrics (only) on this port (the one the chart's monitors scrape)",
    )
    p.add_argument(
        "--redis-stale-after",
        type=float,
        default=10.0,
        help="seconds without reading Redis before its heartbeats expire and known pods are routed "
        "to by load only",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=20.0,
        help="after SIGTERM: seconds the requests in flight get to finish before the router exits "
        "(keep it + preStop sleep under the pod's grace period)",
    )
    p.add_argument(
        "--max-pending-requests",
        type=int,
        default=256,
        help="scale from zero: requests held while no engine is routable; more get 503 "
        "(0: none are held, 503 at once)",
    )
    p.add_argument(
        "--scale-from-zero-timeout",
        type=float,
        default=300.0,
        help="scale from zero: seconds a request is held waiting for an engine before a 503",
    )
    add_flow_arguments(p)
    p.add_argument(
        "--log-format",
        choices=["json", "text"],
        default=os.environ.get("KVMESH_LOG_FORMAT", "json"),
    )
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--no-access-log", action="store_true")


def add_flow_arguments(p: argparse.ArgumentParser) -> None:
    """Flow control (router/flow; docs/router.md, "Flow control")."""
    p.add_argument(
        "--flow-control",
        action="store_true",
        help="queue requests at the router by priority band and per-tenant fair share while every "
        "replica is saturated (off by default, as the Gateway API Inference Extension's flow control)",
    )
    p.add_argument(
        "--flow-band",
        action="append",
        default=None,
        metavar="NAME:PRIORITY[:WEIGHT[:MAX_QUEUED]]",
        help="a priority band, repeated for each (default: critical:2:1:1024, standard:1:1:512, "
        "sheddable:0:1:256); a higher priority goes first and is shed last",
    )
    p.add_argument("--flow-default-band", default="standard", help="band of requests naming none")
    p.add_argument(
        "--flow-objective",
        action="append",
        default=None,
        metavar="OBJECTIVE=BAND",
        help="an x-gateway-inference-objective value mapped to a band (a band's name maps to itself)",
    )
    p.add_argument(
        "--flow-max-queued", type=int, default=1024, help="requests waiting, all bands together"
    )
    p.add_argument(
        "--flow-deadline",
        type=float,
        default=None,
        help="seconds a request may wait at the router before a 503 (default: --request-timeout, "
        "else 60); the x-kvmesh-deadline-seconds header may ask for less",
    )
    p.add_argument(
        "--flow-kv-threshold",
        type=float,
        default=0.8,
        help="a replica whose KV usage is at least this is saturated",
    )
    p.add_argument(
        "--flow-queue-threshold",
        type=int,
        default=5,
        help="a replica whose engine has this many requests waiting is saturated",
    )
    p.add_argument(
        "--flow-pod-max-inflight",
        type=int,
        default=0,
        help="a replica with this many of this router's requests on it is saturated (0: no cap)",
    )
    p.add_argument(
        "--flow-max-tenants",
        type=int,
        default=1024,
        help="tenants tracked for fair share; more share one 'other' flow",
    )
    p.add_argument(
        "--flow-token-weights",
        default="prompt=1,output=2",
        help="virtual tokens per prompt and per output token (fair share's measure of service)",
    )
    p.add_argument(
        "--flow-half-life",
        type=float,
        default=60.0,
        help="seconds after which a tenant's past service counts half",
    )
    p.add_argument(
        "--flow-newcomer-credit",
        type=float,
        default=512.0,
        help="virtual tokens of head start for a tenant that starts asking, below the least-served "
        "tenant waiting (0: VTC's plain lift)",
    )
    p.add_argument(
        "--flow-sync-interval",
        type=float,
        default=1.0,
        help="seconds between syncs of fair share with the other routers through Redis",
    )


def flow_settings(args: argparse.Namespace):
    """The FlowSettings of the flags (SystemExit with the reason when they do not fit)."""
    from kvmesh.router.flow import DEFAULT_BANDS, FlowSettings, parse_band

    try:
        bands = tuple(parse_band(b) for b in args.flow_band) if args.flow_band else DEFAULT_BANDS
        objectives = {}
        for item in args.flow_objective or ():
            name, sep, band = item.partition("=")
            if not sep or not name.strip():
                raise ValueError(f"--flow-objective {item!r}: expected OBJECTIVE=BAND")
            objectives[name.strip().lower()] = band.strip().lower()
        weights = {"prompt": 1.0, "output": 2.0}
        for part in args.flow_token_weights.split(","):
            k, sep, v = part.partition("=")
            if k.strip() not in weights or not sep:
                raise ValueError(f"--flow-token-weights: {part!r} (expected prompt=N,output=N)")
            weights[k.strip()] = float(v)
        if min(weights.values()) < 0:
            raise ValueError("--flow-token-weights must be >= 0")
        deadline = args.flow_deadline or args.request_timeout or 60.0
        return FlowSettings(
            enabled=args.flow_control,
            bands=bands,
            default_band=args.flow_default_band,
            max_queued=args.flow_max_queued,
            default_deadline=deadline,
            kv_threshold=args.flow_kv_threshold,
            queue_threshold=args.flow_queue_threshold,
            pod_max_inflight=args.flow_pod_max_inflight,
            max_tenants=args.flow_max_tenants,
            prompt_weight=weights["prompt"],
            output_weight=weights["output"],
            half_life=args.flow_half_life,
            newcomer_credit=args.flow_newcomer_credit,
            sync_interval=args.flow_sync_interval,
            objectives=objectives,
        )
    except ValueError as exc:
        raise SystemExit(f"kvmesh router: flow control: {exc}") from None


def config_from_args(args: argparse.Namespace):
    from kvmesh.router.app import RouterConfig
    from kvmesh.router.auth import KeyFileError, load_keys
    from kvmesh.router.scoring import Weights

    if args.max_pending_requests < 0:
        raise SystemExit("kvmesh router: --max-pending-requests must be >= 0")
    if not args.scale_from_zero_timeout >= 0:
        raise SystemExit("kvmesh router: --scale-from-zero-timeout must be >= 0")
    try:
        api_keys = load_keys(args.api_keys_file)
    except KeyFileError as exc:  # a missing key file is a startup error, never "no keys"
        raise SystemExit(f"kvmesh router: {exc}") from None
    redis_url = None if (args.redis_url or "").lower() in ("", "none") else args.redis_url
    static_backends = [u.strip() for u in (args.static_backends or "").split(",") if u.strip()]
    try:
        from kvmesh.router.discovery import StaticEndpoints

        StaticEndpoints(static_backends)
    except ValueError as exc:
        raise SystemExit(f"kvmesh router: --static-backends: {exc}") from None
    if not args.resume_timeout >= 0:
        raise SystemExit("kvmesh router: --resume-timeout must be >= 0")
    if args.max_resumes < 0:
        raise SystemExit("kvmesh router: --max-resumes must be >= 0")
    if not args.redis_stale_after > 0:
        raise SystemExit("kvmesh router: --redis-stale-after must be > 0")
    from kvmesh.router.scoring import check_hotspot_params

    flow = flow_settings(args)
    unknown = sorted(
        {k.band for k in (api_keys or {}).values() if k.band and flow.band(k.band) is None}
    )
    if flow.enabled and unknown:
        raise SystemExit(f"kvmesh router: API keys name unknown bands: {unknown}")

    try:
        check_hotspot_params(args.hotspot_ratio, args.hotspot_min_load)
    except ValueError as exc:
        raise SystemExit(f"kvmesh router: --hotspot-ratio/--hotspot-min-load: {exc}") from None
    return RouterConfig(
        model=args.model,
        tokenizer=args.tokenizer,
        redis_url=redis_url,
        static_backends=static_backends,
        backends_file=args.backends_file,
        redis_stale_after=args.redis_stale_after,
        policy=args.policy,
        weights=Weights.parse(args.weights),
        block_size=args.block_size,
        api_keys=api_keys,
        rate_limit_rpm=args.rate_limit_rpm,
        rate_limit_tpm=args.rate_limit_tpm,
        max_body_bytes=args.max_body_bytes,
        max_retries=args.max_retries,
        max_resumes=args.max_resumes,
        resume_timeout=args.resume_timeout,
        engine=args.engine,
        tool_call_parser=args.tool_call_parser,
        connect_timeout=args.connect_timeout,
        read_timeout=args.read_timeout,
        request_timeout=args.request_timeout,
        eject_after=args.eject_after,
        eject_seconds=args.eject_seconds,
        hot_ratio=args.hotspot_ratio,
        hot_min=args.hotspot_min_load,
        session_header=args.session_header,
        redis_timeout=args.redis_timeout,
        refresh_interval=args.refresh_interval,
        upstream_api_key=args.upstream_api_key,
        k8s_service=args.k8s_service,
        k8s_namespace=args.k8s_namespace,
        max_pending_requests=args.max_pending_requests,
        scale_from_zero_timeout=args.scale_from_zero_timeout,
        flow=flow,
    )


def run(args: argparse.Namespace) -> int:
    import logging

    from kvmesh.router.app import Router
    from kvmesh.router.server import make_server

    setup_logging(args.log_format, args.log_level)
    if args.no_access_log:
        logging.getLogger("kvmesh.router.access").setLevel(logging.WARNING)
    cfg = config_from_args(args)
    if not (cfg.static_backends or cfg.backends_file or cfg.k8s_service):
        # Where engines are comes from the platform, never from Redis (anyone who can write
        # Redis could otherwise send users' prompts anywhere): heartbeats only add load.
        raise SystemExit(
            "kvmesh router: no endpoint source: pass --k8s-service (Kubernetes), --static-backends "
            "or --backends-file"
        )
    router = Router(cfg)
    if args.metrics_port is not None:
        from kvmesh.common.metrics_port import serve_metrics_only

        serve_metrics_only(router.metrics.registry, args.host, args.metrics_port)
    logging.getLogger("kvmesh.router").info(
        "router for %s on %s:%d, policy %s, %s, auth %s, flow control %s",
        cfg.model,
        args.host,
        args.port,
        cfg.policy,
        f"static backends {[redact_url(u) for u in cfg.static_backends]}"
        if cfg.static_backends
        else f"redis {redact_url(cfg.redis_url or '')}",
        "on" if cfg.api_keys is not None else "off",
        "on" if cfg.flow.enabled else "off",
    )
    server = make_server(router, args.host, args.port, args.drain_timeout, watchdog=True)
    server.run()
    return 0 if server.started else 1
