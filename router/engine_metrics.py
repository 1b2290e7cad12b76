"""The engine-load reading, kept under its old import path for callers outside the router (kvmesh.common.engine_load)."""

from kvmesh.common.engine_load import EngineLoad, engine_load, parse_prometheus

__all__ = ["EngineLoad", "engine_load", "parse_prometheus"]
