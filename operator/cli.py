"""`kvmesh operator`: run the kopf operator for ModelDeployment resources."""

from __future__ import annotations

import argparse
import asyncio

from kvmesh.common.logging_setup import setup_logging
from kvmesh.operator import render


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="watch only this namespace (repeatable); default: all namespaces",
    )
    parser.add_argument(
        "--liveness-port", type=int, default=8080, help="liveness endpoint port (/healthz)"
    )
    parser.add_argument("--engine-image", default=render.Images.engine, help="default engine image")
    parser.add_argument(
        "--router-image", default=render.Images.router, help="default router/sidecar image"
    )
    parser.add_argument(
        "--redis-image", default=render.Images.redis, help="default managed Redis image"
    )
    parser.add_argument(
        "--status-interval",
        type=float,
        default=10.0,
        help="seconds between status refreshes of non-autoscaled deployments",
    )
    parser.add_argument(
        "--server",
        default=None,
        help="API server URL (default: in-cluster service account, else kubeconfig)",
    )
    parser.add_argument(
        "--managed-redis-url",
        default=None,
        help="reach every managed Redis at this URL instead of its in-cluster Service "
        "(an operator running outside the cluster, e.g. through a port-forward)",
    )
    parser.add_argument("--verbose", action="store_true")


def config_from_args(args: argparse.Namespace):
    from kvmesh.operator.apply import Connection
    from kvmesh.operator.memo import OperatorConfig

    return OperatorConfig(
        images=render.Images(
            engine=args.engine_image, router=args.router_image, redis=args.redis_image
        ),
        connection=Connection(server=args.server) if args.server else None,
        status_interval=args.status_interval,
        managed_redis_url=args.managed_redis_url,
    )


async def run_operator(
    config,
    *,
    namespaces: list[str] | None = None,
    liveness_endpoint: str | None = None,
    stop_flag=None,
    ready_flag=None,
) -> None:
    """Run the operator in the current event loop until ``stop_flag`` is set."""
    import kopf

    from kvmesh.operator.handlers import registry
    from kvmesh.operator.memo import Memo

    await kopf.operator(
        registry=registry,
        memo=Memo(config=config),
        standalone=True,
        clusterwide=not namespaces,
        namespaces=namespaces or (),
        liveness_endpoint=liveness_endpoint,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
    )


def run(args: argparse.Namespace) -> int:
    import kopf

    kopf.configure(verbose=args.verbose)  # kopf's own logger settings; then the one handler, ours
    setup_logging("text", "DEBUG" if args.verbose else "INFO")
    asyncio.run(
        run_operator(
            config_from_args(args),
            namespaces=args.namespace,
            liveness_endpoint=f"http://0.0.0.0:{args.liveness_port}/healthz",
        )
    )
    return 0
