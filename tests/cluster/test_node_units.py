"""The node agent's rules that need no cluster: the image table and Docker's command-line
rules, $(VAR) expansion, Service variables, quantities, the pod phase and the
container states it is computed from."""

from __future__ import annotations

import time

import pytest

from kvmesh_testing.node.containers import Container
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


RUNNING = _status({"running": {"startedAt": "t"}})
EXITED_0 = _status({"terminated": {"exitCode": 0, "reason": "Completed"}})
FAILED = _status({"terminated": {"exitCode": 1, "reason": "Error"}})
KILLED = _status({"terminated": {"exitCode": 137, "reason": "Error", "signal": 9}})
IMAGE_NOT_MAPPED = _status({"waiting": {"reason": "ErrImagePull", "message": "no image"}})
CREATING = _status({"waiting": {"reason": "ContainerCreating"}})
CRASH_LOOP = _status({"waiting": {"reason": "CrashLoopBackOff"}}, FAILED["state"])
RESTARTING_AFTER_0 = _status({"waiting": {"reason": "CrashLoopBackOff"}}, EXITED_0["state"])

# (main containers, phase under Always, OnFailure, Never): kubelet's getPhase
PHASES = [
    ([RUNNING], "Running", "Running", "Running"),
    ([RUNNING, RUNNING], "Running", "Running", "Running"),
    ([EXITED_0], "Running", "Succeeded", "Succeeded"),
    ([EXITED_0, EXITED_0], "Running", "Succeeded", "Succeeded"),
    ([EXITED_0, FAILED], "Running", "Running", "Failed"),
    ([FAILED], "Running", "Running", "Failed"),
    ([KILLED], "Running", "Running", "Failed"),
    ([RUNNING, FAILED], "Running", "Running", "Running"),
    ([RUNNING, EXITED_0], "Running", "Running", "Running"),
    ([IMAGE_NOT_MAPPED], "Pending", "Pending", "Pending"),
    ([RUNNING, IMAGE_NOT_MAPPED], "Pending", "Pending", "Pending"),
    ([EXITED_0, IMAGE_NOT_MAPPED], "Pending", "Pending", "Pending"),
    ([CREATING], "Pending", "Pending", "Pending"),
]


@pytest.mark.parametrize("containers,always,on_failure,never", PHASES)
def test_phase_for_every_restart_policy(containers, always, on_failure, never) -> None:
    for policy, expected in (("Always", always), ("OnFailure", on_failure), ("Never", never)):
        assert phase(policy, False, True, containers) == expected, policy


def test_phase_while_containers_back_off_between_runs() -> None:
    # waiting to restart counts as the run it last had: the pod stays Running
    assert phase("Always", False, True, [CRASH_LOOP]) == "Running"
    assert phase("Always", False, True, [RESTARTING_AFTER_0]) == "Running"
    assert phase("OnFailure", False, True, [CRASH_LOOP]) == "Running"
    assert phase("OnFailure", False, True, [EXITED_0, CRASH_LOOP]) == "Running"
    assert phase("Always", False, True, [CRASH_LOOP, IMAGE_NOT_MAPPED]) == "Pending"


@pytest.mark.parametrize("policy", ["Always", "OnFailure", "Never"])
def test_phase_before_the_init_containers_are_done(policy: str) -> None:
    # an init container still running, waiting for its image or backing off: Pending, whatever
    # the main containers' (not yet created) statuses say
    for containers in ([CREATING], [CREATING, CREATING], [IMAGE_NOT_MAPPED], [RUNNING]):
        assert phase(policy, False, False, containers) == "Pending"


def test_a_failed_init_container_fails_the_pod_only_under_never() -> None:
    # the agent restarts a failed init container under Always and OnFailure (the pod is not
    # initialized, so Pending); under Never it marks the init failed
    assert phase("Never", True, False, [CREATING]) == "Failed"
    assert phase("OnFailure", False, False, [CREATING]) == "Pending"
    assert phase("Always", False, False, [CREATING]) == "Pending"


class _Exited:
    """A finished process as Popen reports it."""

    pid = 4242

    def __init__(self, code: int) -> None:
        self.code = code

    def poll(self) -> int:
        return self.code


def _container(tmp_path, code: int) -> Container:
    c = Container({"name": "app", "image": "img"}, tmp_path)
    c.popen, c.state, c.started_at = _Exited(code), {"running": {"startedAt": "t0"}}, "t0"
    c.started_mono = time.monotonic()  # a short run: the back-off is not reset
    c._kill_group = lambda: None  # no real process group to kill
    return c


@pytest.mark.parametrize(
    "code,exit_code,reason,sig",
    [
        (0, 0, "Completed", None),
        (3, 3, "Error", None),
        (-9, 137, "Error", 9),
        (-15, 143, "Error", 15),
    ],
)
def test_container_terminated_state(tmp_path, code, exit_code, reason, sig) -> None:
    c = _container(tmp_path, code)
    assert c.reap() == exit_code
    term = c.state["terminated"]
    assert set(c.state) == {"terminated"}
    assert (term["exitCode"], term["reason"], term.get("signal")) == (exit_code, reason, sig)
    assert term["startedAt"] == "t0" and term["containerID"] == "kvmesh://4242"
    assert "message" not in term
    assert c.reap() is None  # reaped once
    status = c.status("img")
    assert (status["ready"], status["started"], status["restartCount"]) == (False, False, 0)


def test_container_waiting_states_and_restart_bookkeeping(tmp_path) -> None:
    c = Container({"name": "app", "image": "img"}, tmp_path)
    assert c.state == {"waiting": {"reason": "ContainerCreating"}}
    c.wait("ErrImagePull", "image img is not mapped")
    assert c.status("img")["state"] == {
        "waiting": {"reason": "ErrImagePull", "message": "image img is not mapped"}
    }
    assert phase("Never", False, True, [c.status("img")]) == "Pending"
    c = _container(tmp_path, 1)
    c.reap()
    # the first failure restarts at once, the next after the initial back-off
    assert c.schedule_restart(10, 300) == 0
    assert c.last_state["terminated"]["exitCode"] == 1
    c.wait("CrashLoopBackOff")
    assert c.state == {"waiting": {"reason": "CrashLoopBackOff"}}
    assert phase("OnFailure", False, True, [c.status("img")]) == "Running"
    assert c.schedule_restart(10, 300) == 10 and c.schedule_restart(10, 300) == 20
