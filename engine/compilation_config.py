"""Which CUDA graphs an engine captures, as vLLM's ``--compilation-config`` names them.

``cudagraph_mode``:
  FULL_AND_PIECEWISE  (default) decode-only steps replay a full graph (cuda_graphs.py); every
                      other step up to the largest piecewise size replays piecewise graphs with
                      attention between them (piecewise_graphs.py)
  FULL_DECODE_ONLY    full graphs for decode-only steps; the others eager
  PIECEWISE           piecewise graphs for every step up to the largest size, decodes included
  NONE                eager (as ``--enforce-eager``)

``cudagraph_capture_sizes``: the piecewise graphs' token counts (default: piecewise_sizes up to
``max_cudagraph_capture_size``); ``max_cudagraph_capture_size``: their largest (default the
step's token budget, at most 2048). The full decode graphs' batch sizes follow ``max_num_seqs``.
Graphs are captured on CUDA devices with an attention backend that supports them (Triton).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MODES = ("NONE", "PIECEWISE", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
FIELDS = ("cudagraph_mode", "cudagraph_capture_sizes", "max_cudagraph_capture_size")
DEFAULT_MAX_TOKENS = 2048  # the ladder's top when the token budget is larger: beyond it, eager


def piecewise_sizes(max_tokens: int) -> list[int]:
    """Token counts to capture: 8, 16, 32, then every 64 to 512, every 128 to 1024, every 256
    after, up to max_tokens (itself included): 19 sizes to 2048, each step padded by less than
    a fifth above 512 tokens."""
    sizes = [s for s in (8, 16, 32) if s < max_tokens]
    s = 64
    while s < max_tokens:
        sizes.append(s)
        s += 64 if s < 512 else 128 if s < 1024 else 256
    return sizes + [max_tokens]


@dataclass(frozen=True)
class CompilationConfig:
    cudagraph_mode: str = "FULL_AND_PIECEWISE"
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    max_cudagraph_capture_size: int | None = None

    @classmethod
    def parse(cls, value: Any) -> CompilationConfig:
        """From None, a dict, a JSON object's text or a CompilationConfig; ValueError names the field."""
        if value is None:
            return cls()
        if isinstance(value, CompilationConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"compilation_config: not JSON ({exc.msg})") from None
        if not isinstance(value, dict):
            raise ValueError("compilation_config must be a JSON object")
        unknown = sorted(set(value) - set(FIELDS))
        if unknown:
            raise ValueError(
                f"compilation_config: unknown field(s) {', '.join(unknown)} "
                f"(known: {', '.join(FIELDS)})"
            )
        mode = value.get("cudagraph_mode", cls.cudagraph_mode)
        if not isinstance(mode, str) or mode.upper() not in MODES:
            hint = (
                " (full graphs cover decode-only steps here: FULL_DECODE_ONLY)"
                if mode == "FULL"
                else ""
            )
            raise ValueError(
                f"compilation_config.cudagraph_mode must be one of {', '.join(MODES)}, "
                f"got {mode!r}{hint}"
            )
        sizes = value.get("cudagraph_capture_sizes")
        if sizes is not None:
            if (
                not isinstance(sizes, list)
                or not sizes
                or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes)
            ):
                raise ValueError(
                    "compilation_config.cudagraph_capture_sizes must be a list of positive integers"
                )
            sizes = tuple(sorted(set(sizes)))
        largest = value.get("max_cudagraph_capture_size")
        if largest is not None and (
            not isinstance(largest, int) or isinstance(largest, bool) or largest < 1
        ):
            raise ValueError(
                "compilation_config.max_cudagraph_capture_size must be a positive integer"
            )
        return cls(mode.upper(), sizes, largest)

    @property
    def full_decode(self) -> bool:
        return self.cudagraph_mode in ("FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")

    def piecewise_token_sizes(self, max_num_batched_tokens: int) -> list[int]:
        """The piecewise graphs' token counts for this token budget; [] when none are captured."""
        if self.cudagraph_mode not in ("PIECEWISE", "FULL_AND_PIECEWISE"):
            return []
        largest = self.max_cudagraph_capture_size or min(max_num_batched_tokens, DEFAULT_MAX_TOKENS)
        if self.cudagraph_capture_sizes is not None:
            return [s for s in self.cudagraph_capture_sizes if s <= largest] or [largest]
        return piecewise_sizes(largest)
