"""The thread monitor (engine/cpu_contention.py): the estimate from /proc and the cgroup, the
decision, its hysteresis and bounds, a real busy neighbour, and the engine's step loop using it."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest
import torch

from kvmesh.engine import core_proc, cpu_contention
from kvmesh.engine.cpu_contention import (
    ContentionMonitor,
    Estimate,
    ProcReader,
    Sample,
    estimate,
    monitor_for,
    resolve_adapt,
    target_threads,
)
from kvmesh.engine.threads import available_cpus, plan_threads


# -- fake /proc and cgroup files ------------------------------------------------------------------
def write_proc(root, cpus: dict[int, tuple[int, int, int]], own: dict[str, int], cg=None):
    """cpus: cpu -> (user, system, idle) ticks; own: pid -> utime (stime 0); cg: cpu.stat."""
    (root / "proc").mkdir(exist_ok=True)
    lines = ["cpu  1 2 3 4 5 6 7 8 0 0"]
    for c, (user, system, idle) in cpus.items():
        lines.append(f"cpu{c} {user} 0 {system} {idle} 0 0 0 0 0 0")
    lines.append("intr 12345 0 0")
    (root / "proc" / "stat").write_text("\n".join(lines) + "\n")
    for pid, utime in own.items():
        (root / "proc" / pid).mkdir(exist_ok=True)
        fields = ["S"] + ["0"] * 10 + [str(utime), "0"] + ["0"] * 30
        (root / "proc" / pid / "stat").write_text(f"{pid} (python (x) y) " + " ".join(fields))
    if cg is not None:
        (root / "sys" / "fs" / "cgroup").mkdir(parents=True, exist_ok=True)
        text = "".join(f"{k} {v}\n" for k, v in cg.items())
        (root / "sys" / "fs" / "cgroup" / "cpu.stat").write_text(text)


def test_estimate_counts_busy_time_of_our_cpus_minus_our_own(tmp_path):
    reader = ProcReader([0, 1], pids=("self", "77"), root=str(tmp_path))
    write_proc(tmp_path, {0: (0, 0, 0), 1: (0, 0, 0), 2: (0, 0, 0)}, {"self": 0, "77": 0})
    a = reader.read(now=0.0)
    # 100 ticks per CPU: CPU 0 all busy, CPU 1 half; we used 40, our companion 20. CPU 2 (not
    # ours) busy all along: not counted.
    write_proc(tmp_path, {0: (90, 10, 0), 1: (50, 0, 50), 2: (100, 0, 0)}, {"self": 40, "77": 20})
    b = reader.read(now=1.0)
    est = estimate(a, b, ncpus=2)
    assert est.others == pytest.approx((150 - 60) / 100)
    assert est.left == pytest.approx(2 - 0.9)
    assert target_threads(est, planned=2) == 1
    assert "0.9 of 2 CPUs" in est.reason()


def test_a_companion_that_has_gone_is_skipped(tmp_path):
    write_proc(tmp_path, {0: (0, 0, 10)}, {"self": 5})
    assert ProcReader([0], pids=("self", "999999"), root=str(tmp_path)).read(now=0.0).own == 5


def test_no_time_passed_is_no_estimate(tmp_path):
    write_proc(tmp_path, {0: (5, 0, 5)}, {"self": 0})
    reader = ProcReader([0], root=str(tmp_path))
    assert estimate(reader.read(now=0.0), reader.read(now=0.1), ncpus=1) is None


def test_a_throttled_quota_caps_the_cpus_left(tmp_path):
    reader = ProcReader([0, 1, 2, 3], root=str(tmp_path), quota=2.0)
    idle = {c: (0, 0, 0) for c in range(4)}
    write_proc(tmp_path, idle, {"self": 0}, {"usage_usec": 0, "nr_periods": 0, "nr_throttled": 0})
    a = reader.read(now=0.0)
    # The host's CPUs are half idle, but the cgroup (us: 1 CPU, the rest of it: 0.8 CPU) was
    # throttled in 6 of 10 periods: 2 - 0.8 CPUs are ours.
    busy = {c: (50, 0, 50) for c in range(4)}
    own = cpu_contention.CLK_TCK  # one second of CPU time
    cg = {"usage_usec": 1_800_000, "nr_periods": 10, "nr_throttled": 6}
    write_proc(tmp_path, busy, {"self": own}, cg)
    b = reader.read(now=1.0)
    est = estimate(a, b, ncpus=4, quota=2.0)
    assert est.throttled == pytest.approx(0.6)
    assert est.left == pytest.approx(1.2)
    assert target_threads(est, planned=2) == 1
    assert "throttled in 60%" in est.reason()
    # Not throttled: the quota does not bind, the host's view alone counts.
    busier = {c: (100, 0, 100) for c in range(4)}
    write_proc(tmp_path, busier, {"self": 2 * own}, {**cg, "nr_periods": 20})
    est = estimate(b, reader.read(now=2.0), ncpus=4, quota=2.0)
    assert est.throttled == 0.0 and target_threads(est, planned=2) == 2


def test_target_threads_stays_within_one_and_the_plan():
    assert target_threads(Estimate(others=4.0, cpus=4, left=0.0), planned=4) == 1
    assert target_threads(Estimate(others=0.0, cpus=8, left=8.0), planned=3) == 3
    assert target_threads(Estimate(others=0.4, cpus=2, left=1.6), planned=2) == 2
    assert target_threads(Estimate(others=0.6, cpus=2, left=1.4), planned=2) == 1


# -- the decision over time -----------------------------------------------------------------------
class FakeReader:
    """Samples in which other processes take ``others`` of ``ncpus`` CPUs (100 ticks a read)."""

    def __init__(self, ncpus: int = 2):
        self.cpus = set(range(ncpus))
        self.others = 0.0
        self._busy = self._total = 0

    def read(self, now: float | None = None) -> Sample:
        n = len(self.cpus)
        self._total += 100 * n
        self._busy += int(100 * self.others)
        return Sample(now or 0.0, self._busy, self._total, 0)


def drive(monitor: ContentionMonitor, reader: FakeReader, others: list[float], t0: float = 0.0):
    """One sample per value, INTERVAL apart; the thread count after each."""
    out = []
    for i, o in enumerate(others):
        reader.others = o
        out.append(monitor.maybe_adapt(now=t0 + (i + 1) * cpu_contention.INTERVAL))
    return out


def make(planned: int = 2, ncpus: int = 2):
    applied: list[int] = []
    reader = FakeReader(ncpus)
    mon = ContentionMonitor(reader, planned, applied.append)
    mon.maybe_adapt(now=0.0)  # the baseline
    return mon, reader, applied


def test_down_after_consecutive_samples_and_back_up_when_the_others_leave(caplog):
    mon, reader, applied = make()
    caplog.set_level("INFO", logger="kvmesh.engine.cpu_contention")
    down = cpu_contention.DOWN_SAMPLES
    assert drive(mon, reader, [1.0] * down) == [2] * (down - 1) + [1]
    assert applied == [1]
    assert "2 -> 1 torch threads: other processes use 1.0 of 2 CPUs" in caplog.text
    up = cpu_contention.UP_SAMPLES
    t0 = down * cpu_contention.INTERVAL
    assert drive(mon, reader, [0.0] * up, t0) == [1] * (up - 1) + [2]
    assert applied == [1, 2]


def test_no_flapping_on_alternating_samples():
    mon, reader, applied = make()
    drive(mon, reader, [1.0, 0.0] * 10)
    assert applied == [] and mon.threads == 2


def test_samples_closer_than_the_interval_are_not_taken():
    mon, reader, applied = make()
    for i in range(20):
        reader.others = 2.0
        mon.maybe_adapt(now=0.01 * (i + 1))
    assert applied == []


def test_a_long_gap_starts_a_fresh_baseline():
    mon, reader, applied = make()
    reader.others = 2.0
    for t in (10.0, 20.0, 30.0):  # an idle engine steps rarely: no estimate spans a gap
        mon.maybe_adapt(now=t)
    assert applied == [] and mon.last is None


def test_never_below_one_nor_above_the_plan():
    mon, reader, applied = make(planned=3, ncpus=8)
    drive(mon, reader, [8.0] * 5)
    assert mon.threads == 1
    drive(mon, reader, [0.0] * 10, t0=10.0)
    assert mon.threads == 3 and max(applied) == 3


def test_pinned_thread_counts_are_never_changed(monkeypatch):
    assert resolve_adapt(None, pinned=False) and not resolve_adapt(None, pinned=True)
    assert resolve_adapt(True, pinned=True) and not resolve_adapt(False, pinned=False)
    assert monitor_for(None, 4, pinned=True, apply=print) is None
    assert monitor_for(False, 4, pinned=False, apply=print) is None
    assert monitor_for(None, 1, pinned=False, apply=print) is None  # nothing to take away
    assert monitor_for(None, 2, pinned=False, apply=print).planned == 2
    assert plan_threads(omp_threads=2, cpus=[0, 1, 2, 3], env={}).pinned
    assert plan_threads(cpus=[0, 1, 2, 3], env={"OMP_NUM_THREADS": "2"}).pinned
    assert not plan_threads(cpus=[0, 1, 2, 3], env={}).pinned


# -- a real neighbour -----------------------------------------------------------------------------
def test_a_busy_loop_beside_us_is_seen():
    reader = ProcReader(available_cpus())
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        seen = []
        prev = reader.read()
        for _ in range(8):
            time.sleep(0.5)
            cur = reader.read()
            est = estimate(prev, cur, len(reader.cpus))
            prev = cur
            if est is not None:
                seen.append(est.others)
            if seen and max(seen) >= 0.5:
                break
    finally:
        busy.kill()
        busy.wait()
    assert max(seen) >= 0.5, seen


# -- the engine's step loop -----------------------------------------------------------------------
def test_the_core_process_leaves_its_api_process_out_and_only_the_cpu_engine_adapts():
    import os
    from types import SimpleNamespace

    from kvmesh.engine.config import EngineArgs

    def core(device="cpu", **args):
        return SimpleNamespace(
            device=torch.device(device),
            args=EngineArgs(**args),
            num_threads=2,
            set_threads=lambda n: None,
        )

    shared = plan_threads(cpus=[0, 1], env={})
    mon = core_proc.thread_monitor(core(), shared)
    assert mon.planned == 2 and mon.reader.pids == ("self", str(os.getppid()))
    apart = plan_threads(cpus=[0, 1, 2, 3], env={})  # the frontend keeps CPU 0
    assert core_proc.thread_monitor(core(), apart).reader.pids == ("self",)
    pinned = plan_threads(omp_threads=2, cpus=[0, 1], env={})
    assert core_proc.thread_monitor(core(), pinned) is None
    assert core_proc.thread_monitor(core(adapt_threads=True), pinned) is not None
    assert core_proc.thread_monitor(core(adapt_threads=False), shared) is None
    assert core_proc.thread_monitor(core("meta"), shared) is None


@pytest.mark.parametrize("scheduling", ["--no-async-scheduling", "--async-scheduling"])
def test_the_step_loop_adapts_and_metrics_show_it(tiny_llama_dir, monkeypatch, scheduling):
    from tests.engine.server.conftest import ThreadServer

    monitors: list[ContentionMonitor] = []

    def busy_node_monitor(flag, planned, pinned, apply, companions=(), quota=None):
        reader = FakeReader(2)
        reader.others = 2.0  # every CPU taken by others: one thread
        monitors.append(ContentionMonitor(reader, 2, apply))
        return monitors[-1]

    monkeypatch.setattr(core_proc, "monitor_for", busy_node_monitor)
    monkeypatch.setattr(cpu_contention, "INTERVAL", 0.0)
    before = torch.get_num_threads()
    srv = ThreadServer(
        ["--model", tiny_llama_dir, "--engine-mode", "thread", "--num-kv-blocks", "64", scheduling]
    ).start()
    try:
        body = {"model": tiny_llama_dir, "prompt": "hello", "max_tokens": 8, "ignore_eos": True}
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert monitors and monitors[0].threads == 1
        assert srv.state.engine.stats.engine_threads == 1
        core = srv.state.engine.engine.core
        if scheduling == "--async-scheduling":  # the step thread runs the forwards: it set it too
            assert core.async_scheduling and core._step_thread_threads == 1
        text = httpx.get(f"{srv.url}/metrics", timeout=10).text
        assert any(
            line.startswith("kvmesh:engine_threads{") and line.endswith(" 1.0")
            for line in text.splitlines()
        ), text
    finally:
        srv.stop()
        torch.set_num_threads(before)  # the process-wide default new threads start from
