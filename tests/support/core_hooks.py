"""Hooks run inside the engine core (its process or its thread) by tests: fault injection and core state.

The production core loop knows no such call. A test server runs ``HookedCoreLoop`` instead
(``engine.core_loop = HookedCoreLoop`` before the engine starts: the thread mode builds it, the
process mode sends it to the core process in its config), and then
``engine.call_utility("hook", "kvmesh_testing.core_hooks:<function>", *args)`` runs
``<function>(core, *args)`` in the core between steps (only functions of kvmesh_testing may be
named), through the same path whichever engine mode the server runs.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvmesh.engine.core_proc import CoreLoop

HOOK_PREFIX = "kvmesh_testing."  # the only modules a "hook" call may run
_SAVED = "_kvmesh_hook_saved"


class HookedCoreLoop(CoreLoop):
    """The production core loop plus the "hook" utility call."""

    def utility(self, name: str, args: list[Any]) -> Any:
        if name != "hook":
            return super().utility(name, args)
        path, *rest = args
        module, _, fn = str(path).partition(":")
        if not module.startswith(HOOK_PREFIX) or not fn:
            raise ValueError(f"hooks must name a function in {HOOK_PREFIX}*, got {path!r}")
        return getattr(importlib.import_module(module), fn)(self.core, *rest)


def _wrap(obj, name: str, make) -> None:
    saved = obj.__dict__.setdefault(_SAVED, {})
    if name not in saved:  # the first hook on it: remember what to put back
        saved[name] = (name in vars(obj), vars(obj).get(name))
    setattr(obj, name, make(getattr(obj, name)))


def restore(core) -> None:
    """Undo every hook installed on this core."""
    for obj in (core, core.runner):
        for name, (had_own, value) in vars(obj).pop(_SAVED, {}).items():
            if had_own:
                setattr(obj, name, value)
            else:
                vars(obj).pop(name, None)  # the class's method again
    core._kvmesh_hook_log = []


def poison_prompt_token(core, token: int) -> None:
    """Every model run holding a request whose prompt contains ``token`` raises; the sizes of those
    runs are logged (``hook_log``)."""
    core._kvmesh_hook_log = []

    def make(real):
        def execute(out, kv):
            if any(token in r.prompt_token_ids for r in out.requests):
                core._kvmesh_hook_log.append(len(out.requests))
                raise RuntimeError("injected fault")
            return real(out, kv)

        return execute

    _wrap(core.runner, "execute", make)


def slow_steps(core, seconds: float) -> None:
    """Every model run takes at least ``seconds`` longer: requests stay in flight for as long as a
    test needs them there, however slowly its own client is scheduled."""
    import time

    def make(real):
        def execute(out, kv):
            time.sleep(seconds)
            return real(out, kv)

        return execute

    _wrap(core.runner, "execute", make)


def fail_step(core, nth: int) -> None:
    """The ``nth`` call of ``core.step`` from now raises (outside the model run: the last resort)."""
    calls = {"n": 0}

    def make(real):
        def step():
            calls["n"] += 1
            if calls["n"] == nth:
                raise RuntimeError("injected engine failure")
            return real()

        return step

    _wrap(core, "step", make)


def hook_log(core) -> list:
    return list(getattr(core, "_kvmesh_hook_log", []))


def cached_blocks(core) -> dict[int, int | None]:
    """The prefix cache: block key -> its parent's key."""
    return {k: b.parent_key for k, b in core.kv.pool.cached.items()}


def kv_state(core) -> dict:
    return {
        "num_free_blocks": core.kv.pool.num_free_blocks,
        "num_blocks": core.kv.num_blocks,
        "num_running": core.scheduler.num_running,
        "num_waiting": core.scheduler.num_waiting,
        "prefix_hits": core.kv.prefix_hits,
        "num_preemptions": core.scheduler.num_preemptions,
        "cached": {k: b.parent_key for k, b in core.kv.pool.cached.items()},
    }


def async_state(core) -> dict:
    return {
        "async_scheduling": core.async_scheduling,
        "num_async_steps": core.num_async_steps,
        "num_sync_steps": core.num_sync_steps,
        "in_flight": len(core._in_flight),
    }


def exit_now(core, code: int = 1) -> None:
    """The core process dies on the spot (no cleanup): what a segfault or the OOM killer does."""
    import os

    os._exit(code)
