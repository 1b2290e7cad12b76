"""Starting and stopping local clusters: two side by side in slots of their own, everything
they made removed on stop, and what a crashed cluster left removed by the next one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from kvmesh.testing.cluster import LOCK_DIR, LocalCluster
from kvmesh.testing.node import network
from tests.cluster.conftest import IMAGES, namespace, pod, require_cluster, wait_for, wait_pod


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


def test_two_clusters_side_by_side_and_nothing_left_after_stop(tmp_path: Path) -> None:
    require_cluster()
    with LocalCluster(tmp_path / "a", images=IMAGES) as a, LocalCluster(tmp_path / "b", images=IMAGES) as b:
        assert a.net.slot != b.net.slot
        made = []
        for c in (a, b):
            ns = namespace(c, "side")
            c.api.apply(pod("web", ns, [{"name": "web", "image": "example.com/standin:1"}]))
            p = wait_pod(c, ns, "web", lambda p: p["status"].get("podIP") and p["status"].get("phase") == "Running")
            assert p["status"]["podIP"].startswith(f"10.244.{c.net.slot}.")
            made.append((c.net, c.processes(ns, "web")["web"]))
        for net, _ in made:
            assert net.bridge in _links() and any(net.owns_netns(n) for n in _netns())
    for net, pid in made:
        assert net.bridge not in _links()
        assert not any(net.owns_netns(n) for n in _netns())
        assert not any(link.startswith(f"kvm{net.slot}h") for link in _links())
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def test_a_crashed_cluster_is_cleaned_up_by_the_next_in_its_slot(tmp_path: Path) -> None:
    require_cluster()
    script = ("import sys, time\nfrom pathlib import Path\nfrom kvmesh.testing.cluster import LocalCluster\n"
              "c = LocalCluster(Path(sys.argv[1]))\nc.start()\nprint(c.net.slot, flush=True)\ntime.sleep(600)\n")
    crashed = subprocess.Popen([sys.executable, "-P", "-c", script, str(tmp_path / "crashed")], stdout=subprocess.PIPE,
                               text=True)
    try:
        slot = int(crashed.stdout.readline())
        bridge = network.NetworkConfig(slot).bridge
        assert bridge in _links()
        agent_log = tmp_path / "crashed" / "control-plane" / "node-agent.log"
        wait_for(lambda: "ready" in agent_log.read_text(), message="the crashed cluster's node")
    finally:
        crashed.send_signal(signal.SIGKILL)   # no chance to clean up
        crashed.wait()
    recorded = (LOCK_DIR / f"slot-{slot}.pids").read_text()
    assert bridge in _links(), "the crashed cluster's bridge outlives it"
    # its agent notices that its parent is gone and stops
    wait_for(lambda: "stopping" in agent_log.read_text(), timeout=15, message="the orphaned agent stops")
    with LocalCluster(tmp_path / "next") as nxt:
        if nxt.net.slot == slot:   # another session may have taken the slot meanwhile
            assert bridge in _links()   # its own, made fresh
    for pid, cmdline in json.loads(recorded):
        try:
            alive = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace") == cmdline
        except OSError:
            alive = False
        if nxt.net.slot == slot:
            assert not alive, f"leftover process {pid} of the crashed cluster still runs"


def test_the_cli_brings_a_cluster_up_and_down(tmp_path: Path) -> None:
    require_cluster()
    proc = subprocess.Popen([sys.executable, "-P", "-m", "kvmesh.testing.cluster", "up", "--workdir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = proc.stdout.readline()
        assert first.startswith("kubeconfig: "), first + proc.stdout.read()
        kubeconfig = first.split(": ", 1)[1].strip()
        nodes = subprocess.run(["kubectl", "--kubeconfig", kubeconfig, "get", "nodes", "-o", "name"],
                               capture_output=True, text=True, timeout=60)
        assert nodes.stdout.strip() == "node/kvmesh-node", nodes.stderr
        pods_cidr = next(line for line in proc.stdout if line.startswith("pods get IPs in"))
        slot = int(pods_cidr.split("10.244.")[1].split(".")[0])
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert network.NetworkConfig(slot).bridge not in _links()
