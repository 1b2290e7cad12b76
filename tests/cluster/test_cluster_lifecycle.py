"""Starting and stopping local clusters: two side by side in slots of their own, everything
they made removed on stop, and what a crashed cluster left removed by the next one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from kvmesh_testing.cluster import LOCK_DIR, LocalCluster
from kvmesh_testing.node import network
from tests.cluster.conftest import IMAGES, namespace, pod, require_cluster, wait_for, wait_pod


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


def test_two_clusters_side_by_side_and_nothing_left_after_stop(tmp_path: Path) -> None:
    require_cluster()
    with (
        LocalCluster(tmp_path / "a", images=IMAGES) as a,
        LocalCluster(tmp_path / "b", images=IMAGES) as b,
    ):
        assert a.net.slot != b.net.slot
        made = []
        for c in (a, b):
            ns = namespace(c, "side")
            c.api.apply(pod("web", ns, [{"name": "web", "image": "example.com/standin:1"}]))
            p = wait_pod(
                c,
                ns,
                "web",
                lambda p: p["status"].get("podIP") and p["status"].get("phase") == "Running",
            )
            assert p["status"]["podIP"].startswith(f"10.244.{c.net.slot}.")
            made.append((c.net, c.processes(ns, "web")["web"]))
        for net, _ in made:
            assert net.bridge in _links() and any(net.owns_netns(n) for n in _netns())
    for net, pid in made:
        assert net.bridge not in _links()
        assert not any(net.owns_netns(n) for n in _netns())
        assert not any(link.startswith(f"kvm{net.slot}h") for link in _links())
        assert (
            not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
        )


CRASHING = (
    "import sys, time\nfrom pathlib import Path\nfrom kvmesh_testing.cluster import LocalCluster\n"
    "c = LocalCluster(Path(sys.argv[1]), images={'example.com/python:*': [sys.executable]})\nc.start()\n"
    "c.api.apply({'apiVersion': 'v1', 'kind': 'Pod', 'metadata': {'name': 'p', 'namespace': 'default'},"
    " 'spec': {'containers': [{'name': 'c', 'image': 'example.com/python:1',"
    " 'args': ['-c', 'import time; time.sleep(600)']}]}})\n"
    "print(c.net.slot, flush=True)\ntime.sleep(600)\n"
)


def _start_and_crash(workdir: Path, *, with_watchdog: bool) -> tuple[int, list[int]]:
    """A cluster (with one pod running) in another process, killed without a chance to stop it:
    (its slot, the pids it recorded)."""
    crashed = subprocess.Popen(
        [sys.executable, "-P", "-c", CRASHING, str(workdir)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        slot = int(crashed.stdout.readline())
        wait_for(
            lambda: any(network.NetworkConfig(slot).owns_netns(n) for n in _netns()),
            message="its pod's netns",
        )
        recorded = [pid for pid, _ in json.loads((LOCK_DIR / f"slot-{slot}.pids").read_text())]
    finally:
        if with_watchdog:
            crashed.send_signal(signal.SIGKILL)
        else:  # the watchdog too (it is in the cluster process's group; the cluster's parts are not)
            os.killpg(crashed.pid, signal.SIGKILL)
        crashed.wait()
    return slot, recorded


def _kill_what_is_left(slot: int, recorded: list[int]) -> None:
    """A failed check must not leave the crashed cluster's parts running (an orphaned
    kube-scheduler would outlive the suite): SIGKILL them and remove the slot's network."""
    for pid in recorded:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    network.remove_leftovers(network.NetworkConfig(slot))


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_watchdog_cleans_up_after_a_crashed_cluster(tmp_path: Path) -> None:
    require_cluster()
    slot, recorded = _start_and_crash(tmp_path, with_watchdog=True)
    net = network.NetworkConfig(slot)
    try:
        wait_for(
            lambda: not any(_alive(pid) for pid in recorded),
            timeout=40,
            message="its processes stopped",
        )
        wait_for(
            lambda: net.bridge not in _links() and not any(net.owns_netns(n) for n in _netns()),
            timeout=20,
            message="its network removed",
        )
    finally:
        _kill_what_is_left(slot, recorded)


def test_the_next_cluster_in_a_slot_cleans_up_what_a_crash_left(tmp_path: Path) -> None:
    require_cluster()
    slot, recorded = _start_and_crash(tmp_path / "crashed", with_watchdog=False)
    net = network.NetworkConfig(slot)
    try:
        assert net.bridge in _links() and any(_alive(pid) for pid in recorded), (
            "the crash left its parts behind"
        )
        with LocalCluster(tmp_path / "next", slot=slot):
            assert not any(_alive(pid) for pid in recorded)
            assert not any(net.owns_netns(n) for n in _netns()), (
                "the crashed cluster's pod namespace is gone"
            )
        assert net.bridge not in _links()
    finally:
        _kill_what_is_left(slot, recorded)


def test_the_cli_brings_a_cluster_up_and_down(tmp_path: Path) -> None:
    require_cluster()
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "kvmesh_testing.cluster", "up", "--workdir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        first = proc.stdout.readline()
        assert first.startswith("kubeconfig: "), first + proc.stdout.read()
        kubeconfig = first.split(": ", 1)[1].strip()
        nodes = subprocess.run(
            ["kubectl", "--kubeconfig", kubeconfig, "get", "nodes", "-o", "name"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert nodes.stdout.strip() == "node/kvmesh-node", nodes.stderr
        pods_cidr = next(line for line in proc.stdout if line.startswith("pods get IPs in"))
        slot = int(pods_cidr.split("10.244.")[1].split(".")[0])
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert network.NetworkConfig(slot).bridge not in _links()
