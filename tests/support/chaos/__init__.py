"""Chaos and overload scenarios on loopback: real processes, real signals, every client request classified."""

from kvmesh_testing.chaos.faults import ChaosConfig, run_chaos
from kvmesh_testing.chaos.lifecycle import LoopbackMesh
from kvmesh_testing.chaos.load import WORDS, Load, Result, send_one, words
from kvmesh_testing.chaos.mesh import Engine, Mesh, MeshConfig
from kvmesh_testing.chaos.overload import BULK_KEY, LIMITED_KEY, OverloadConfig, run_overload
from kvmesh_testing.chaos.processes import ChaosError, Proc, child_env, wait_for
from kvmesh_testing.chaos.report import (
    ChaosReport,
    OverloadReport,
    Part,
    RedisFault,
    RoutingCheck,
    UpRestart,
    UpRestartReport,
    percentile,
)
from kvmesh_testing.chaos.up_mesh import STUB_ENGINE_ARGS, UpConfig, UpMesh
from kvmesh_testing.chaos.up_restarts import (
    KILL_RACE_S,
    UP_SCENARIOS,
    UpRestartConfig,
    run_up_restarts,
    up_restart,
)

__all__ = [
    "BULK_KEY",
    "KILL_RACE_S",
    "LIMITED_KEY",
    "STUB_ENGINE_ARGS",
    "UP_SCENARIOS",
    "WORDS",
    "ChaosConfig",
    "ChaosError",
    "ChaosReport",
    "Engine",
    "Load",
    "LoopbackMesh",
    "Mesh",
    "MeshConfig",
    "OverloadConfig",
    "OverloadReport",
    "Part",
    "Proc",
    "RedisFault",
    "Result",
    "RoutingCheck",
    "UpConfig",
    "UpMesh",
    "UpRestart",
    "UpRestartConfig",
    "UpRestartReport",
    "child_env",
    "percentile",
    "run_chaos",
    "run_overload",
    "run_up_restarts",
    "send_one",
    "up_restart",
    "wait_for",
    "words",
]
