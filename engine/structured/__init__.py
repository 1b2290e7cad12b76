"""Constrained decoding (structured outputs) on xgrammar: the request's spec (params), grammars
compiled off the step loop and cached (compiler), the per-request matcher (matcher) and the batched
next-token mask (bitmask). docs/structured-outputs.md describes the surface and the backend choice."""

from kvmesh.engine.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
