"""Where an engine step's time goes: schedule / prepare / forward / sample / update / output.

``StepTimer.install(core)`` wraps the few calls one step makes (the scheduler's ``schedule`` and
``update_from_output``, the runner's ``prepare``, its model and its sampler) in place, on that
core's objects only, so the engine files stay as they are. Each wrapper adds two
``perf_counter`` calls (well under a microsecond); ``output`` is the rest of the step (building
the step's outputs, prompt logprobs, bookkeeping) plus, in the process mode, encoding and sending
them. Totals are cumulative seconds; the server exports them as
``kvmesh:engine_step_phase_seconds_total{phase=...}`` (engine/server/metrics.py).

On a CPU device the model runs synchronously, so ``forward`` is the model's time. On an
accelerator the kernels run ahead; their time then shows up where the host first waits for them
(``sample``: the copy of the sampled token ids).

The decode-step split (steps in which every scheduled request decodes one token) is kept apart:
``decode_*`` entries and ``decode_steps`` / ``decode_seqs``, which bench/step_overhead.py turns into
the Python overhead per decode step (the step's wall time minus the model's forward).
"""

from __future__ import annotations

import time
from typing import Any

PHASES = ("schedule", "prepare", "forward", "sample", "update", "output")


class _TimedCall:
    """A callable object (the model, the sampler) timed on each call; attributes pass through."""

    def __init__(self, inner: Any, timer: StepTimer, phase: str):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_timer", timer)
        object.__setattr__(self, "_phase", phase)

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self._inner(*args, **kwargs)
        finally:
            self._timer.current[self._phase] += time.perf_counter() - t0

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._inner, name, value)


class StepTimer:
    def __init__(self) -> None:
        self.totals: dict[str, float] = {p: 0.0 for p in PHASES}
        self.totals.update({f"decode_{p}": 0.0 for p in PHASES})
        self.steps = 0
        self.decode_steps = 0
        self.decode_seqs = 0
        self.current: dict[str, float] = {p: 0.0 for p in PHASES}
        self._t0 = 0.0
        self._decode = False
        self._num_seqs = 0

    @classmethod
    def install(cls, core) -> StepTimer:
        timer = cls()
        timer._wrap_method(core.scheduler, "schedule", "schedule", watch_batch=True)
        timer._wrap_method(core.scheduler, "update_from_output", "update")
        timer._wrap_method(core.scheduler, "update_from_async_output", "update")
        timer._wrap_method(core.runner, "prepare", "prepare")
        core.runner.model = _TimedCall(core.runner.model, timer, "forward")
        core.runner.sampler = _TimedCall(core.runner.sampler, timer, "sample")
        return timer

    def _wrap_method(self, obj: Any, name: str, phase: str, watch_batch: bool = False) -> None:
        real = getattr(obj, name)
        current = self.current

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                result = real(*args, **kwargs)
            finally:
                current[phase] += time.perf_counter() - t0
            if watch_batch:
                counts = result.num_scheduled_tokens.values()
                self._num_seqs = len(counts)
                self._decode = bool(counts) and all(n == 1 for n in counts)
            return result

        setattr(obj, name, timed)

    # -- around one step --------------------------------------------------------------------
    def begin(self) -> None:
        for p in PHASES:
            self.current[p] = 0.0
        self._decode = False
        self._num_seqs = 0
        self._t0 = time.perf_counter()

    def end(self, extra_output_s: float = 0.0) -> None:
        """Close the step (``extra_output_s``: sending its outputs, measured by the caller)."""
        wall = time.perf_counter() - self._t0 + extra_output_s
        cur = self.current
        cur["output"] = max(0.0, wall - sum(cur[p] for p in PHASES if p != "output"))
        if not self._num_seqs:
            return  # nothing was scheduled (only abort outputs went out)
        self.steps += 1
        for p in PHASES:
            self.totals[p] += cur[p]
        if self._decode:
            self.decode_steps += 1
            self.decode_seqs += self._num_seqs
            for p in PHASES:
                self.totals[f"decode_{p}"] += cur[p]

    def snapshot(self) -> dict[str, float]:
        snap = dict(self.totals)
        snap["steps"] = float(self.steps)
        snap["decode_steps"] = float(self.decode_steps)
        snap["decode_seqs"] = float(self.decode_seqs)
        return snap


def overhead_per_step(snap: dict[str, float], decode: bool = True) -> dict[str, float]:
    """Milliseconds per step of each phase, and ``overhead``: everything but the forward."""
    key = "decode_steps" if decode else "steps"
    n = snap.get(key, 0.0)
    if not n:
        return {}
    prefix = "decode_" if decode else ""
    out = {p: 1000 * snap[prefix + p] / n for p in PHASES}
    out["total"] = sum(out[p] for p in PHASES)
    out["overhead"] = out["total"] - out["forward"]
    if decode and snap.get("decode_seqs"):
        out["batch"] = snap["decode_seqs"] / n
    return out
