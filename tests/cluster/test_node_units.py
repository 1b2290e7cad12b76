"""The node agent's rules that need no cluster: the image table and Docker's command-line
rules, $(VAR) expansion, Service variables, quantities, the pod phase."""

from __future__ import annotations

import pytest

from kvmesh_testing.node.envvars import (
    ConfigError,
    expand,
    quantity,
    resource_field,
    service_variables,
)
from kvmesh_testing.node.images import VENV_BIN, Image, ImageNotMapped, ImageTable
from kvmesh_testing.node.status import phase


def test_the_project_images_run_the_kvmesh_cli_from_the_venv() -> None:
    table = ImageTable()
    engine = table.lookup("ghcr.io/kvmesh/engine:0.1.0")
    assert engine.argv(None, None) == ["kvmesh", "serve"]
    assert engine.argv(None, ["serve", "--port", "9"]) == [
        "kvmesh",
        "serve",
        "--port",
        "9",
    ]  # args replace CMD
    assert engine.argv(["kvmesh", "serve"], ["--x"]) == [
        "kvmesh",
        "serve",
        "--x",
    ]  # command replaces ENTRYPOINT
    assert engine.path[0] == VENV_BIN and engine.env["HOME"] == "/tmp"
    assert table.lookup("ghcr.io/kvmesh/operator:dev").argv(None, None) == [
        "kvmesh",
        "operator",
        "--liveness-port",
        "8080",
    ]
    assert table.lookup("ghcr.io/kvmesh/router:1").argv(None, None) == ["kvmesh", "router"]


def test_redis_gets_the_official_images_entrypoint_rule() -> None:
    redis = ImageTable().lookup("redis:7.4-alpine")
    assert redis.argv(None, ["--port", "6379"]) == [
        "redis-server",
        "--protected-mode",
        "no",
        "--port",
        "6379",
    ]
    assert redis.argv(None, None) == ["redis-server", "--protected-mode", "no"]
    assert redis.argv(None, ["redis-server", "/etc/redis.conf", "--save", ""]) == [
        "redis-server",
        "/etc/redis.conf",
        "--protected-mode",
        "no",
        "--save",
        "",
    ]
    assert redis.argv(["sh", "-c", "true"], None) == ["sh", "-c", "true"]
    assert ImageTable().lookup("redis") == redis  # no tag: latest


def test_unknown_images_are_refused_and_test_entries_come_first() -> None:
    with pytest.raises(ImageNotMapped, match="quay.io/x/y:1"):
        ImageTable().lookup("quay.io/x/y:1")
    table = ImageTable({"ghcr.io/kvmesh/engine:*": ["python", "-m", "stub"]})
    assert table.lookup("ghcr.io/kvmesh/engine:1").argv(None, ["--port", "1"]) == [
        "python",
        "-m",
        "stub",
        "--port",
        "1",
    ]
    assert Image(entrypoint=("a",), cmd=("b",)).argv(None, []) == ["a", "b"]


def test_dollar_paren_expansion() -> None:
    env = {"A": "1", "POD_IP": "10.0.0.2"}
    assert expand("http://$(POD_IP):8000", env) == "http://10.0.0.2:8000"
    assert expand("$(MISSING) stays", env) == "$(MISSING) stays"
    assert expand("$$(A) is escaped, $(A) is not", env) == "$(A) is escaped, 1 is not"
    assert expand("$A and $ alone", env) == "$A and $ alone"


def test_service_variables_as_the_kubelet_sets_them() -> None:
    env = service_variables(
        [
            ("chat-redis", "10.96.0.9", [{"name": "redis", "port": 6379, "protocol": "TCP"}]),
            ("headless", "None", [{"port": 1}]),
        ]
    )
    assert (
        env["CHAT_REDIS_SERVICE_HOST"] == "10.96.0.9" and env["CHAT_REDIS_SERVICE_PORT"] == "6379"
    )
    assert env["CHAT_REDIS_SERVICE_PORT_REDIS"] == "6379"
    assert env["CHAT_REDIS_PORT"] == "tcp://10.96.0.9:6379"
    assert env["CHAT_REDIS_PORT_6379_TCP_ADDR"] == "10.96.0.9"
    assert not any(k.startswith("HEADLESS") for k in env)


def test_quantities_and_resource_fields() -> None:
    assert (
        quantity("64Mi") == 64 * 2**20
        and quantity("500m") * 1000 == 500
        and quantity("1e3") == 1000
    )
    with pytest.raises(ConfigError):
        quantity("ten")
    container = {"resources": {"requests": {"cpu": "250m"}, "limits": {"memory": "1Gi"}}}
    assert resource_field(container, {"resource": "requests.cpu"}, {}) == "1"  # rounded up
    assert resource_field(container, {"resource": "requests.cpu", "divisor": "1m"}, {}) == "250"
    assert resource_field(container, {"resource": "limits.memory", "divisor": "1Mi"}, {}) == "1024"
    assert (
        resource_field(container, {"resource": "limits.cpu"}, {"cpu": "16"}) == "16"
    )  # unset: the node's


def _status(state: dict, last: dict | None = None) -> dict:
    return {"state": state, "lastState": last or {}}


def test_pod_phase() -> None:
    running, waiting = (
        _status({"running": {}}),
        _status({"waiting": {"reason": "ContainerCreating"}}),
    )
    ok, bad = _status({"terminated": {"exitCode": 0}}), _status({"terminated": {"exitCode": 2}})
    backing_off = _status(
        {"waiting": {"reason": "CrashLoopBackOff"}}, {"terminated": {"exitCode": 1}}
    )
    assert phase("Always", False, False, [running]) == "Pending"  # init containers not done
    assert phase("Always", True, False, [waiting]) == "Failed"
    assert phase("Always", False, True, [running, waiting]) == "Pending"
    assert phase("Always", False, True, [running, backing_off]) == "Running"
    assert phase("Always", False, True, [ok, bad]) == "Running"
    assert phase("OnFailure", False, True, [ok, bad]) == "Running"
    assert phase("OnFailure", False, True, [ok, ok]) == "Succeeded"
    assert phase("Never", False, True, [ok, bad]) == "Failed"
    assert phase("Never", False, True, [ok]) == "Succeeded"


def test_slots_whose_ranges_the_host_routes_are_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    from kvmesh_testing.node import network

    routes = (
        "default via 192.0.2.1 dev eth0\n10.244.0.0/16 dev cni0 proto kernel scope link\n"
        "10.96.3.0/24 dev kvmbr3 proto kernel scope link\nlocal 10.96.5.1 dev lo table local\n"
    )
    monkeypatch.setattr(
        network, "ip", lambda *a, check=True: subprocess.CompletedProcess(a, 0, routes, "")
    )
    assert network.conflicts(network.NetworkConfig(7)) == [
        "10.244.0.0/16"
    ]  # a CI runner's pod network
    monkeypatch.setattr(
        network,
        "ip",
        lambda *a, check=True: subprocess.CompletedProcess(
            a, 0, routes.replace("10.244.0.0/16 dev cni0", "172.16.0.0/12 dev cni0"), ""
        ),
    )
    assert (
        network.conflicts(network.NetworkConfig(3)) == []
    )  # a cluster bridge's own route is the lock's business


def test_created_mount_points_go_once_no_other_cluster_runs(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fcntl

    from kvmesh_testing.node import hostpaths

    monkeypatch.setattr(hostpaths, "STATE_DIR", tmp_path / "state")
    monkeypatch.setattr(hostpaths, "LOCK", tmp_path / "state" / "mount-points.lock")
    monkeypatch.setattr(hostpaths, "LOG", tmp_path / "state" / "mount-points.created")
    (tmp_path / "state").mkdir()
    empty, used, empty_file = tmp_path / "models", tmp_path / "data", tmp_path / "etc-hosts-like"
    empty.mkdir()
    used.mkdir()
    (used / "kept").write_text("x")
    empty_file.touch()
    hostpaths.LOG.write_text("".join(f"{p}\n" for p in (empty, used, empty_file)))
    other = open(tmp_path / "state" / "slot-5.lock", "w")
    fcntl.flock(
        other, fcntl.LOCK_EX | fcntl.LOCK_NB
    )  # another cluster runs: its pods may have them mounted
    (tmp_path / "state" / "slot-2.lock").touch()  # ours (held by us, so not looked at)
    assert hostpaths.remove_created_mount_points(own_slot=2) == []
    assert empty.exists()
    other.close()
    assert sorted(hostpaths.remove_created_mount_points(own_slot=2)) == sorted(
        [str(empty), str(empty_file)]
    )
    assert not empty.exists() and not empty_file.exists() and (used / "kept").exists()
    assert hostpaths.LOG.read_text() == ""


def test_each_control_plane_process_is_reported_as_it_starts(tmp_path) -> None:
    # The cluster records these pids for its watchdog: a crash between two starts must leave
    # every process started so far recorded, so each start reports the whole list.
    from kvmesh_testing.controlplane import ControlPlane

    seen: list[list[str]] = []
    cp = ControlPlane(assets=None, workdir=tmp_path)
    cp.on_spawn = lambda procs: seen.append([p.name for p in procs])
    try:
        for name in ("etcd", "kube-apiserver", "kube-scheduler"):
            cp._spawn(name, ["sleep", "30"])
        assert seen == [
            ["etcd"],
            ["etcd", "kube-apiserver"],
            ["etcd", "kube-apiserver", "kube-scheduler"],
        ]
    finally:
        for proc in cp.procs:
            proc.popen.kill()
            proc.popen.wait()
