"""Thread placement for the engine core process and the API (frontend) process.

The core process runs the model on torch's intra-op (OpenMP) threads; the frontend runs HTTP,
tokenisation, detokenisation and SSE on one Python thread. On a CPU host they share the cores.

``plan_threads`` decides, from the CPUs this process may use (its affinity mask, capped by its
cgroup's CPU quota: a container's CPU limit):

- ``--omp-threads N`` (or ``OMP_NUM_THREADS`` in the environment, as every OpenMP program reads it):
  the core's torch threads; otherwise all CPUs not reserved for the frontend.
- ``--frontend-cores K``: CPUs left to the frontend. The core process is then pinned to the other
  CPUs (its OpenMP threads never land on the frontend's), and its thread count defaults to them.
  ``auto`` reserves one CPU when there are at least 4 (as vLLM's CPU backend leaves one to its API
  server), none on smaller machines: on 2 CPUs, reserving one halves the model's compute while the
  frontend needs a fraction of a core (docs/performance.md has the measurement).

This is the plan at start; between steps cpu_contention.py lowers the torch thread count while
other processes take CPU time on these CPUs (unless the count was pinned), and restores it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)

AUTO_RESERVE_MIN_CPUS = 4


@dataclass
class ThreadPlan:
    core_threads: int  # torch.set_num_threads in the core process
    core_cpus: list[int] | None  # sched_setaffinity of the core process (None: not pinned)
    frontend_cpus: list[int] | None  # the CPUs reserved for the frontend (None: shared)
    cpu_quota: float | None = None  # the cgroup's CPU limit, in CPUs (None: none)
    pinned: bool = False  # core_threads set by --omp-threads or OMP_NUM_THREADS

    def describe(self) -> str:
        pin = f", pinned to CPUs {_ranges(self.core_cpus)}" if self.core_cpus else ", not pinned"
        front = (
            f"; frontend keeps CPUs {_ranges(self.frontend_cpus)}"
            if self.frontend_cpus
            else "; frontend shares them"
        )
        return f"engine core: {self.core_threads} torch threads{pin}{front}"


def _ranges(cpus: list[int] | None) -> str:
    return ",".join(map(str, cpus or []))


def available_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup") -> float | None:
    """The CPU quota of this process's cgroup (a container's CPU limit) in CPUs, or None. The
    affinity mask shows every CPU of the node; a pod limited to 2 of 16 that ran 16 OpenMP
    threads would be throttled at every barrier."""
    try:
        quota, period = (
            open(f"{root}/cpu.max").read().split()[:2]
        )  # cgroup v2: "max 100000" / "200000 100000"
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:  # cgroup v1
        quota = int(open(f"{root}/cpu/cpu.cfs_quota_us").read())
        period = int(open(f"{root}/cpu/cpu.cfs_period_us").read())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def plan_threads(
    omp_threads: int | None = None,
    frontend_cores: int | str | None = "auto",
    cpus: list[int] | None = None,
    env: dict | None = None,
    cpu_limit: float | None = None,
) -> ThreadPlan:
    if cpus is None:
        cpus = available_cpus()
        cpu_limit = cgroup_cpu_limit() if cpu_limit is None else cpu_limit
    cpus = list(cpus)
    if cpu_limit is not None and cpu_limit < len(cpus):
        cpus = cpus[: max(1, int(cpu_limit))]  # the CPUs the quota pays for
    env = os.environ if env is None else env
    if frontend_cores in (None, "auto"):
        reserve = 1 if len(cpus) >= AUTO_RESERVE_MIN_CPUS else 0
    else:
        reserve = int(frontend_cores)
        if not 0 <= reserve < len(cpus):
            raise ValueError(
                f"--frontend-cores must be in [0, {len(cpus) - 1}] on {len(cpus)} CPUs, "
                f"got {frontend_cores}"
            )
    core_cpus = cpus[reserve:] if reserve else None
    if (
        omp_threads is None
        and env.get("OMP_NUM_THREADS", "").isdigit()
        and int(env["OMP_NUM_THREADS"]) > 0
    ):
        omp_threads = int(env["OMP_NUM_THREADS"])
    if omp_threads is not None and omp_threads <= 0:
        raise ValueError(f"--omp-threads must be positive, got {omp_threads}")
    threads = omp_threads or len(core_cpus or cpus)
    return ThreadPlan(
        threads, core_cpus, cpus[:reserve] or None, cpu_limit, omp_threads is not None
    )


# OpenMP's own knobs for how an idle thread waits at a barrier. libgomp reads them once, when it
# loads (with torch), so they go into the core process's environment, not os.environ at run time.
WAIT_POLICY_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


# How long an OpenMP thread that reaches a barrier first spins before it sleeps (libgomp's default:
# 300,000 iterations). Short where the core's CPUs may be contended; long where the core shares
# them with the frontend alone (spin_count).
SPIN_COUNT = 100_000
SHARED_SPIN_COUNT = 1_000_000


def spin_count(plan: ThreadPlan | None) -> int:
    """The core's OpenMP spin. Beside its own API process (the frontend sharing the core's CPUs,
    no CPU quota) a worker that stays awake between steps wins: with 100k spins it sleeps through
    the serial part of a server's step and the next forward's first barrier waits for its wake-up,
    behind the API process's turn on that CPU. Measured interleaved (docs/performance.md): the server on
    the prefix workload +5.1% at 1M spins (6 of 6 rounds), random and the engine alone unchanged.
    Under a CPU quota, spinning spends the quota the API process draws on too, and beside other busy
    processes a long spin takes the CPU the awaited thread needs (1M: 223 ms a step, 100k: 124 ms):
    there, 100k."""
    if plan is not None and plan.frontend_cpus is None and plan.cpu_quota is None:
        return SHARED_SPIN_COUNT
    return SPIN_COUNT


def core_environment(plan: ThreadPlan | None, env: dict | None = None) -> dict[str, str]:
    """The environment the core process starts with: the caller's, plus its thread count and the
    OpenMP spin of spin_count() (``GOMP_SPINCOUNT``) unless the caller chose a wait policy itself.

    Why: a thread that reaches a barrier first spins. Where the core's threads are not alone on
    their CPUs (other pods on the node, a CFS quota), a long spin burns the time slice the awaited
    thread needs, and each of a forward's hundreds of parallel regions pays for it. Measured on
    the 2-CPU development machine, decode steps of 16 (docs/performance.md): alone, default 78-84 ms,
    100k spins 81-88 ms, passive waiting 96-115 ms; beside two busy processes, default 305 ms, 100k
    spins 178 ms, passive 186 ms."""
    out = dict(os.environ if env is None else env)
    if plan is not None:
        out["OMP_NUM_THREADS"] = str(plan.core_threads)
    if not any(v in out for v in WAIT_POLICY_VARS):
        out["GOMP_SPINCOUNT"] = str(spin_count(plan))
    return out


def apply_in_core(plan: ThreadPlan) -> None:
    """In the core process, before the model loads."""
    os.environ["OMP_NUM_THREADS"] = str(plan.core_threads)
    if plan.core_cpus:
        try:
            os.sched_setaffinity(0, plan.core_cpus)
        except (AttributeError, OSError) as exc:  # not Linux, or CPUs we may not use
            log.warning("could not pin the engine core to CPUs %s: %s", plan.core_cpus, exc)
    import torch

    torch.set_num_threads(plan.core_threads)
