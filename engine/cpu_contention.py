"""Torch's thread count adapted, between steps, to the CPU time other processes take on our CPUs.

Why: the core runs one OpenMP thread per CPU it may use, and every parallel region of a forward
(hundreds per step) ends at a barrier. When a process outside the engine keeps one of those CPUs
busy, the kernel time-slices one of our threads with it and each region waits for the
descheduled thread: a step costs a time slice per region, not the lost CPU's share. With one
thread fewer, the team fits on the CPUs left and loses only that share.

``ContentionMonitor.maybe_adapt()`` runs between steps (at most every ``INTERVAL`` seconds). It
reads the per-CPU busy time of the CPUs in our affinity mask (/proc/stat, steal included), minus
this process's own CPU time and its companions' (the API process sharing the core's CPUs:
/proc/<pid>/stat), and under a cgroup CPU quota the cgroup's usage and throttling
(cpu.stat): while the cgroup was throttled, the quota the others in it leave caps the CPUs left.
The thread count is the CPUs left, rounded, in [1, planned]; it changes only after several
consecutive samples agree (down faster than up), and goes back up when the others leave.

What stays: libgomp reads its spin (``GOMP_SPINCOUNT``, threads.spin_count) once, when torch
loads, so the spin the core started with holds whatever the monitor decides: 1M iterations
beside its own API process, 100k under a CPU quota or pinned apart from the API process. At one
thread there is no barrier to spin at (the pool's idle threads sleep after one spin); with more,
the spin a waiting thread burns is time the neighbour would otherwise get, and the threads it
waits for now fit on the CPUs left. The CPU affinity is not changed either.

torch.set_num_threads sets the OpenMP team size of the thread that calls it (libgomp keeps it per
thread), so the monitor applies it on the thread that runs the forward (EngineCore.set_threads).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

INTERVAL = 0.5  # seconds between samples
MAX_WINDOW = 5.0  # a longer gap (an idle engine) starts a fresh baseline
DOWN_SAMPLES = 2  # consecutive samples before fewer threads (a contended step is very slow)
UP_SAMPLES = 4  # consecutive samples before more threads
THROTTLED = 0.2  # the quota binds when at least this share of the periods were throttled
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # /proc's time unit


@dataclass
class Sample:
    t: float  # monotonic seconds
    busy: int  # ticks: the CPUs' busy time, summed over our CPUs
    total: int  # ticks: the CPUs' busy + idle time, summed over our CPUs
    own: int  # ticks: our process's (and its companions') CPU time
    cg_usage_us: int | None = None  # the cgroup's CPU time (cgroup v2 cpu.stat)
    cg_periods: int | None = None
    cg_throttled: int | None = None


@dataclass
class Estimate:
    others: float  # CPUs other processes took on our CPUs
    cpus: int  # our CPUs
    left: float  # the CPUs our threads can count on
    throttled: float | None = None  # share of the quota's periods throttled (None: no quota)

    def reason(self) -> str:
        text = f"other processes use {self.others:.1f} of {self.cpus} CPUs"
        if self.throttled is not None:
            text += f", cgroup throttled in {self.throttled:.0%} of periods"
        return text


class ProcReader:
    """Two small reads per sample: /proc/stat and /proc/<pid>/stat of ours (plus the cgroup's
    cpu.stat under a quota). ``root`` is the filesystem root, so tests give a folder of fakes."""

    def __init__(
        self,
        cpus: list[int],
        pids: tuple[str, ...] = ("self",),
        root: str = "/",
        quota: float | None = None,
    ):
        self.cpus = {f"cpu{c}" for c in cpus}
        self.pids = pids
        self.root = root.rstrip("/")
        self.quota = quota

    def read(self, now: float | None = None) -> Sample:
        busy = total = 0
        with open(f"{self.root}/proc/stat") as f:
            for line in f:
                name, _, rest = line.partition(" ")
                if name not in self.cpus:
                    continue
                # user nice system idle iowait irq softirq steal (guest is inside user)
                v = [int(x) for x in rest.split()[:8]]
                busy += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
                total += sum(v)
        sample = Sample(time.monotonic() if now is None else now, busy, total, self._own())
        if self.quota is not None:
            self._read_cgroup(sample)
        return sample

    def _own(self) -> int:
        ticks = 0
        for pid in self.pids:
            try:
                with open(f"{self.root}/proc/{pid}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:  # a companion that has gone
                continue
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
        return ticks

    def _read_cgroup(self, sample: Sample) -> None:
        try:
            with open(f"{self.root}/sys/fs/cgroup/cpu.stat") as f:
                stat = dict(line.split() for line in f if line.strip())
            sample.cg_usage_us = int(stat["usage_usec"])
            sample.cg_periods = int(stat.get("nr_periods", 0))
            sample.cg_throttled = int(stat.get("nr_throttled", 0))
        except (OSError, KeyError, ValueError):  # cgroup v1 or no cpu controller: host view only
            pass


def estimate(prev: Sample, cur: Sample, ncpus: int, quota: float | None = None) -> Estimate | None:
    """What other processes took on our CPUs between two samples; None when too little time
    passed to tell."""
    d_total = cur.total - prev.total
    if d_total <= 0:
        return None
    wall_ticks = d_total / ncpus  # each CPU's elapsed ticks
    others = (cur.busy - prev.busy - (cur.own - prev.own)) / wall_ticks
    others = min(max(others, 0.0), float(ncpus))
    left = ncpus - others
    throttled = None
    if quota is not None and cur.cg_periods is not None and prev.cg_periods is not None:
        periods = cur.cg_periods - prev.cg_periods
        throttled = (cur.cg_throttled - prev.cg_throttled) / periods if periods > 0 else 0.0
        if throttled >= THROTTLED:
            # The quota binds: the rest of our cgroup (besides us) draws on it too.
            elapsed_us = (cur.t - prev.t) * 1e6
            own_us = (cur.own - prev.own) * 1e6 / CLK_TCK
            cg_others = max(0.0, (cur.cg_usage_us - prev.cg_usage_us - own_us) / elapsed_us)
            left = min(left, quota - cg_others)
    return Estimate(others, ncpus, left, throttled)


def target_threads(est: Estimate, planned: int) -> int:
    """The CPUs left, rounded half up, in [1, planned]."""
    return max(1, min(planned, int(est.left + 0.5)))


class ContentionMonitor:
    """Decides the torch thread count from samples; ``apply(n)`` sets it (on the forward's
    thread)."""

    def __init__(self, reader: ProcReader, planned: int, apply, quota: float | None = None):
        self.reader = reader
        self.planned = planned
        self.threads = planned
        self.apply = apply
        self.quota = quota
        self.ncpus = len(reader.cpus)
        self._prev: Sample | None = None
        self._proposal: int | None = None
        self._votes = 0
        self.last: Estimate | None = None

    def maybe_adapt(self, now: float | None = None) -> int:
        """Between steps: sample when INTERVAL has passed, and change the count when enough
        consecutive samples ask for it. Returns the current count."""
        now = time.monotonic() if now is None else now
        prev = self._prev
        if prev is not None and now - prev.t < INTERVAL:
            return self.threads
        try:
            cur = self.reader.read(now)
        except (OSError, ValueError, IndexError):  # no /proc: nothing to adapt to
            return self.threads
        self._prev = cur
        if prev is None or now - prev.t > MAX_WINDOW:
            return self.threads
        est = estimate(prev, cur, self.ncpus, self.quota)
        if est is not None:
            self.last = est
            self._vote(target_threads(est, self.planned), est)
        return self.threads

    def _vote(self, want: int, est: Estimate) -> None:
        if want == self.threads:
            self._proposal, self._votes = None, 0
            return
        if want != self._proposal:
            self._proposal, self._votes = want, 0
        self._votes += 1
        if self._votes < (DOWN_SAMPLES if want < self.threads else UP_SAMPLES):
            return
        log.info("%d -> %d torch threads: %s", self.threads, want, est.reason())
        self.apply(want)
        self.threads = want
        self._proposal, self._votes = None, 0


def resolve_adapt(flag: bool | None, pinned: bool) -> bool:
    """--adapt-threads: on by default unless the thread count was pinned (--omp-threads or
    OMP_NUM_THREADS)."""
    return (not pinned) if flag is None else flag


def monitor_for(
    flag: bool | None,
    planned: int,
    pinned: bool,
    apply,
    companions: tuple[int, ...] = (),
    quota: float | None = None,
) -> ContentionMonitor | None:
    """The monitor of an engine whose torch threads number ``planned``, or None when adapting is
    off (or there is one thread: nothing to take away)."""
    if not resolve_adapt(flag, pinned) or planned <= 1:
        return None
    from kvmesh.engine.threads import available_cpus

    pids = ("self", *map(str, companions))
    return ContentionMonitor(ProcReader(available_cpus(), pids, quota=quota), planned, apply, quota)
