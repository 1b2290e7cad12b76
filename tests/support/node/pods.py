"""One pod's life on the node, as the kubelet runs it: a network namespace and IP, volumes,
init containers in order, the containers with their probes and restarts, status reports,
and on delete: preStop hooks, SIGTERM, SIGKILL after the grace period, then the final delete."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvmesh_testing.node import network
from kvmesh_testing.node.api import ApiError
from kvmesh_testing.node.containers import Container, Launch
from kvmesh_testing.node.envvars import ConfigError, container_env, expand, service_variables
from kvmesh_testing.node.images import ImageNotMapped, base_path
from kvmesh_testing.node.probes import Target, run_handler
from kvmesh_testing.node.restarts import FAIL_POD, NEXT, RESTART, after_exit
from kvmesh_testing.node.status import Conditions, now, phase
from kvmesh_testing.node.volumes import PodVolumes

if TYPE_CHECKING:
    from kvmesh_testing.node.agent import Agent

log = logging.getLogger(__name__)
TICK = 0.1
VOLUME_SYNC_SECONDS = (
    5.0  # the kubelet syncs API-backed volumes about every minute; tests want it sooner
)


def pod_dir(root: Path, namespace: str, name: str, uid: str) -> Path:
    return root / "pods" / namespace / name / uid


class PodWorker(threading.Thread):
    def __init__(self, agent: Agent, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.agent, self.pod = agent, pod
        self.namespace, self.pod_name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.dir = pod_dir(agent.state_dir, self.namespace, self.pod_name, self.uid)
        self.gone = threading.Event()  # the pod left the API (deleted with grace 0 by someone)
        self.shutdown = threading.Event()  # the agent stops: kill everything quickly
        self.ip_index: int | None = None
        self.pod_ip = ""
        self.netns = ""
        self.start_time = ""
        self.conditions = Conditions()
        self.init_containers = [
            Container(c, self.dir / "logs", init=True)
            for c in pod["spec"].get("initContainers") or []
        ]
        self.containers = [Container(c, self.dir / "logs") for c in pod["spec"]["containers"]]
        for c in self.init_containers + self.containers:
            c.on_probe_failure = self._probe_failed(c.name)
        self.init_index = 0
        self.init_failed = False
        self.volumes: PodVolumes | None = None
        self.volumes_ready = False
        self.last_report: dict[str, Any] | None = None
        self.last_pids: dict[str, int] = {}
        self.config_retry_at = 0.0
        self.volumes_synced_at = 0.0

    # --- helpers ------------------------------------------------------------------------------

    def _event(
        self, reason: str, message: str, warning: bool = False, container: str | None = None
    ) -> None:
        self.agent.events.record(self.pod, reason, message, warning=warning, container=container)

    def _probe_failed(self, container: str):
        def report(kind: str, why: str) -> None:
            self._event(
                "Unhealthy",
                f"{kind.capitalize()} probe failed: {why}",
                warning=True,
                container=container,
            )

        return report

    @property
    def spec(self) -> dict[str, Any]:
        return self.pod["spec"]

    @property
    def restart_policy(self) -> str:
        return self.spec.get("restartPolicy", "Always")

    def update(self, pod: dict[str, Any]) -> None:
        self.pod = pod

    def _lookup(self, kind: str, name: str) -> dict[str, Any] | None:
        plural = {"Secret": "secrets", "ConfigMap": "configmaps"}[kind]
        return self.agent.api.get(f"/api/v1/namespaces/{self.namespace}/{plural}/{name}")

    def _request_token(self, service_account: str, spec: dict[str, Any]) -> str:
        resp = self.agent.api.create(
            f"/api/v1/namespaces/{self.namespace}/serviceaccounts/{service_account}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
        )
        return resp["status"]["token"]

    # --- setup --------------------------------------------------------------------------------

    def _setup(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.start_time = now()
        self.conditions.set("PodReadyToStartContainers", False)
        self.conditions.set("Initialized", not self.init_containers, "ContainersNotInitialized")
        self.conditions.set("ContainersReady", False, "ContainersNotReady")
        self.conditions.set("Ready", False, "ContainersNotReady")
        self.ip_index = self.agent.ips.allocate()
        self.pod_ip = network.pod_ip(self.agent.net, self.ip_index)
        self.netns = network.setup_pod_network(self.agent.net, self.ip_index)
        etc = self.dir / "etc"
        etc.mkdir(exist_ok=True)
        (etc / "hostname").write_text(self.pod_name[:63] + "\n")
        (etc / "resolv.conf").write_text(
            f"search {self.namespace}.svc.cluster.local svc.cluster.local cluster.local\noptions ndots:5\n"
        )
        self.refresh_hosts()
        self.conditions.set("PodReadyToStartContainers", True)
        self.volumes = PodVolumes(
            self.pod,
            self.dir / "volumes",
            lookup=self._lookup,
            request_token=self._request_token,
            claim_path=lambda claim: self.agent.claim_path(self.namespace, claim),
            allocatable=self.agent.allocatable,
        )

    def _try_setup(self) -> bool:
        """The pod's sandbox (network namespace, files); on failure the containers wait with
        the reason, and the kubelet's way is to try again."""
        try:
            self._setup()
            return True
        except (OSError, RuntimeError) as exc:
            log.warning("%s/%s: pod sandbox setup failed: %s", self.namespace, self.pod_name, exc)
            self._event(
                "FailedCreatePodSandBox", f"Failed to create pod sandbox: {exc}", warning=True
            )
            self._teardown_network()
            for c in self.init_containers + self.containers:
                c.wait("ContainerCreating", f"FailedCreatePodSandBox: {exc}")
            self._report()
            return False

    def refresh_hosts(self) -> None:
        """/etc/hosts of the pod: itself and the cluster's Services (rewritten in place: the
        containers bind-mount this file)."""
        if not self.pod_ip:
            return
        text = self.agent.hosts_for(self.namespace, self.pod_ip, self.pod_name)
        path = self.dir / "etc" / "hosts"
        try:
            if path.exists() and path.read_text() == text:
                return
            with path.open("r+" if path.exists() else "w") as f:
                f.write(text)
                f.truncate()
        except OSError:
            pass

    def _implicit_mounts(self) -> list[dict[str, Any]]:
        etc = self.dir / "etc"
        return [
            {"source": str(etc / n), "target": f"/etc/{n}", "readOnly": False}
            for n in ("hosts", "resolv.conf", "hostname")
        ]

    def _launch(self, container: Container) -> Launch | None:
        """Resolve a container's image, env and mounts; on failure set its waiting reason."""
        spec = container.spec
        try:
            image = self.agent.images.lookup(spec["image"])
        except ImageNotMapped as exc:
            container.wait("ErrImagePull", str(exc))
            self._event(
                "Failed",
                f'Failed to pull image "{spec["image"]}": {exc}',
                warning=True,
                container=container.name,
            )
            return None
        base = {"HOME": "/root", **image.env}  # a runtime's default for a root user
        base["PATH"] = base_path(image)
        base["HOSTNAME"] = self.pod_name[:63]
        if self.spec.get("enableServiceLinks", True):
            base.update(service_variables(self.agent.service_links(self.namespace)))
        # the API server's variables (KUBERNETES_SERVICE_HOST/PORT, KUBERNETES_PORT_443_TCP...) go to every pod
        base.update(
            service_variables(
                [
                    (
                        "kubernetes",
                        self.agent.net.apiserver_service_ip,
                        [{"name": "https", "port": 443, "protocol": "TCP"}],
                    )
                ]
            )
        )
        pod = dict(self.pod)
        pod["status"] = {
            **(self.pod.get("status") or {}),
            "podIP": self.pod_ip,
            "podIPs": [{"ip": self.pod_ip}],
            "hostIP": self.agent.net.gateway,
            "hostIPs": [{"ip": self.agent.net.gateway}],
        }
        try:
            env = container_env(
                pod, spec, base=base, lookup=self._lookup, node_allocatable=self.agent.allocatable
            )
            assert self.volumes is not None
            mounts = self._implicit_mounts() + self.volumes.mounts(spec, env)
        except (ConfigError, ApiError) as exc:
            container.wait("CreateContainerConfigError", str(exc))
            self._event("Failed", f"Error: {exc}", warning=True, container=container.name)
            return None
        argv = image.argv(
            [expand(a, env) for a in spec.get("command") or []],
            [expand(a, env) for a in spec.get("args") or []],
        )
        if not argv:
            container.wait("CreateContainerError", "no command specified")
            return None
        return Launch(argv, env, mounts, spec.get("workingDir") or image.working_dir)

    def _start(self, container: Container) -> bool:
        launch = self._launch(container)
        if launch is None:
            return False
        container.start(
            launch, netns=self.netns, hostname=self.pod_name, pod_ip=self.pod_ip, state_dir=self.dir
        )
        self._event(
            "Pulled",
            f'Container image "{container.spec["image"]}" already present on machine',
            container=container.name,
        )
        self._event("Created", f"Created container: {container.name}", container=container.name)
        self._event("Started", f"Started container {container.name}", container=container.name)
        log.info(
            "%s/%s: started %s (pid %s)",
            self.namespace,
            self.pod_name,
            container.name,
            container.popen.pid,
        )
        return True

    # --- the loop ------------------------------------------------------------------------------

    def run(self) -> None:
        try:
            self._run()
        except Exception:
            log.exception("%s/%s: pod worker failed", self.namespace, self.pod_name)
            self._kill_all()
        finally:
            self._teardown_network()
            self.agent.worker_done(self)

    def _deleting(self) -> bool:
        return bool(self.pod["metadata"].get("deletionTimestamp"))

    def _run(self) -> None:
        while not self._try_setup():
            if self.gone.wait(2) or self.shutdown.is_set():
                return
            if self._deleting():
                break
        while not self.gone.is_set() and not self.shutdown.is_set():
            if self._deleting():
                self._terminate_pod()
                return
            if self.config_retry_at <= time.monotonic():
                try:
                    assert self.volumes is not None
                    if not self.volumes_ready:
                        self.volumes.prepare()
                        self.volumes_ready = True
                        self.volumes_synced_at = time.monotonic()
                    elif time.monotonic() - self.volumes_synced_at >= VOLUME_SYNC_SECONDS:
                        self.volumes.pod = self.pod
                        self.volumes.refresh()
                        self.volumes_synced_at = time.monotonic()
                except (ConfigError, ApiError) as exc:
                    for c in self.init_containers + self.containers:
                        c.wait("ContainerCreating", f"MountVolume.SetUp failed: {exc}")
                    self._event("FailedMount", f"MountVolume.SetUp failed: {exc}", warning=True)
                    self.config_retry_at = time.monotonic() + 2
                else:
                    self._step()
            self._report()
            if self._terminal():
                self._teardown_network()
            self.gone.wait(TICK)
        self._kill_all()

    def _terminal(self) -> bool:
        return (self.last_report or {}).get("phase") in ("Succeeded", "Failed")

    def _step(self) -> None:
        if self.init_index < len(self.init_containers):
            self._step_init()
            return
        for c in self.containers:
            self._step_container(c)

    def _step_init(self) -> None:
        c = self.init_containers[self.init_index]
        if self.init_failed:
            return
        if "running" in c.state:
            code = c.reap()
            if code is None:
                return
            action = after_exit(self.restart_policy, code, init=True)
            if action == NEXT:
                self.init_index += 1
                if self.init_index == len(self.init_containers):
                    self.conditions.set("Initialized", True)
            elif action == FAIL_POD:
                self.init_failed = True
            else:
                self._restart_later(c)
            return
        if c.next_start <= time.monotonic() and not self._start(c):
            c.next_start = time.monotonic() + 1  # try the image/config again in a second

    def _restart_later(self, c: Container) -> None:
        delay = c.schedule_restart(self.agent.backoff_initial, self.agent.backoff_cap)
        c.restart_count += 1
        c.wait("CrashLoopBackOff", self._backoff_message(c))
        if delay > 0:
            self._event(
                "BackOff",
                f"Back-off restarting failed container {c.name} in pod "
                f"{self.pod_name}_{self.namespace}({self.uid})",
                warning=True,
                container=c.name,
            )

    def _backoff_message(self, c: Container) -> str:
        delay = max(0, round(c.next_start - time.monotonic()))
        return f"back-off {delay}s restarting failed container={c.name} pod={self.pod_name}_{self.namespace}({self.uid})"

    def _step_container(self, c: Container) -> None:
        if "running" in c.state:
            failure = c.probe_failure()
            if failure and c.kill_deadline is None:
                log.info("%s/%s: %s; restarting", self.namespace, self.pod_name, failure)
                self._event("Killing", f"{failure}, will be restarted", container=c.name)
                c.terminate(self._grace(), failure)
            code = c.reap()
            if code is None:
                return
            if after_exit(self.restart_policy, code, init=False) == RESTART:
                self._restart_later(c)
            return
        if "terminated" in c.state:
            return
        if c.next_start <= time.monotonic():
            if not self._start(c):
                c.next_start = time.monotonic() + 1  # try the image/config again in a second
        elif c.state.get("waiting", {}).get("reason") == "CrashLoopBackOff":
            c.wait("CrashLoopBackOff", self._backoff_message(c))

    def _grace(self) -> float:
        return float(self.spec.get("terminationGracePeriodSeconds", 30))

    # --- deletion ------------------------------------------------------------------------------

    def _terminate_pod(self) -> None:
        meta = self.pod["metadata"]
        grace = float(meta.get("deletionGracePeriodSeconds", self._grace()))
        deadline = time.monotonic() + grace
        running = [c for c in self.init_containers + self.containers if "running" in c.state]
        hooks = [
            threading.Thread(target=self._pre_stop, args=(c, grace), daemon=True)
            for c in running
            if (c.spec.get("lifecycle") or {}).get("preStop")
        ]
        for t in hooks:
            t.start()
        while (
            any(t.is_alive() for t in hooks)
            and time.monotonic() < deadline
            and not self.gone.is_set()
        ):
            self._tick_reap(running)
            self._report()
            time.sleep(TICK)
        remaining = max(
            deadline - time.monotonic(), 2.0 if hooks else 0.0
        )  # kubelet: 2 s after a long preStop
        for c in running:
            self._event("Killing", f"Stopping container {c.name}", container=c.name)
            c.terminate(0 if self.gone.is_set() else remaining, "")
        while any("running" in c.state for c in running):
            self._tick_reap(running)
            self._report()
            time.sleep(TICK)
        for c in self.init_containers + self.containers:
            if "waiting" in c.state:  # never ran: the kubelet reports it terminated
                c.state = {
                    "terminated": {
                        "exitCode": 137 if c.last_state else 0,
                        "reason": "ContainerStatusUnknown" if c.last_state else "Completed",
                        "finishedAt": now(),
                    }
                }
        self.conditions.set("ContainersReady", False, "ContainersNotReady")
        self.conditions.set("Ready", False, "ContainersNotReady")
        self._report()
        self._teardown_network()
        try:
            self.agent.api.delete(
                f"/api/v1/namespaces/{self.namespace}/pods/{self.pod_name}",
                {
                    "kind": "DeleteOptions",
                    "apiVersion": "v1",
                    "gracePeriodSeconds": 0,
                    "preconditions": {"uid": self.uid},
                },
            )
        except ApiError as exc:
            if exc.status != 409:  # 409: already replaced by a pod of the same name
                raise

    def _tick_reap(self, containers: list[Container]) -> None:
        for c in containers:
            c.reap()

    def _pre_stop(self, c: Container, grace: float) -> None:
        handler = c.spec["lifecycle"]["preStop"]
        target = Target(
            self.pod_ip,
            {
                p["name"]: int(p["containerPort"])
                for p in c.spec.get("ports") or []
                if p.get("name")
            },
            c.popen.pid if c.popen else 0,
            c.env,
        )
        ok, why = run_handler(handler, target, timeout=grace)
        if not ok:
            log.info("%s/%s: preStop of %s failed: %s", self.namespace, self.pod_name, c.name, why)

    def kill_containers(self) -> None:
        """SIGKILL every container's processes (the agent stopping)."""
        for c in self.init_containers + self.containers:
            c.stop_probes()
            c.force_kill()

    def teardown_network(self) -> None:
        self._teardown_network()

    def _kill_all(self) -> None:
        for c in self.init_containers + self.containers:
            c.stop_probes()
            c.force_kill()
            if "running" in c.state:
                c.reap()

    def _teardown_network(self) -> None:
        if self.ip_index is not None:
            network.teardown_pod_network(self.agent.net, self.ip_index)
            self.agent.ips.release(self.ip_index)
            self.ip_index = None
            self.netns = ""

    # --- status --------------------------------------------------------------------------------

    def _status(self) -> dict[str, Any]:
        statuses = [c.status(c.spec["image"]) for c in self.containers]
        init_statuses = [c.status(c.spec["image"]) for c in self.init_containers]
        initialized = self.init_index >= len(self.init_containers)
        ready = initialized and all(c.ready for c in self.containers)
        self.conditions.set("ContainersReady", ready, "ContainersNotReady")
        self.conditions.set("Ready", ready, "ContainersNotReady")
        pod_phase = phase(self.restart_policy, self.init_failed, initialized, statuses)
        existing = (self.pod.get("status") or {}).get("conditions") or []
        status: dict[str, Any] = {
            "phase": pod_phase,
            "conditions": self.conditions.merged(existing),
            "hostIP": self.agent.net.gateway,
            "hostIPs": [{"ip": self.agent.net.gateway}],
            "startTime": self.start_time,
            "containerStatuses": statuses,
        }
        if self.pod_ip:
            status.update(podIP=self.pod_ip, podIPs=[{"ip": self.pod_ip}])
        elif self.last_report and self.last_report.get("podIP"):
            status.update(podIP=self.last_report["podIP"], podIPs=self.last_report["podIPs"])
        if init_statuses:
            status["initContainerStatuses"] = init_statuses
        return status

    def _comparable(self, status: dict[str, Any]) -> str:
        return json.dumps(status, sort_keys=True)

    def _report(self) -> None:
        self._write_pids()
        status = self._status()
        if self.last_report is not None and self._comparable(status) == self._comparable(
            self.last_report
        ):
            return
        path = f"/api/v1/namespaces/{self.namespace}/pods/{self.pod_name}/status"
        for _ in range(5):
            pod = dict(self.pod)
            pod["status"] = {**(pod.get("status") or {}), **status}
            try:
                self.pod = self.agent.api.put(path, pod)
                self.last_report = status
                return
            except ApiError as exc:
                if exc.status == 404:
                    self.gone.set()
                    return
                if exc.status != 409:
                    log.warning(
                        "%s/%s: status update failed: %s", self.namespace, self.pod_name, exc
                    )
                    return
                fresh = self.agent.api.get(
                    f"/api/v1/namespaces/{self.namespace}/pods/{self.pod_name}"
                )
                if fresh is None or fresh["metadata"]["uid"] != self.uid:
                    self.gone.set()
                    return
                self.pod = fresh

    def _write_pids(self) -> None:
        pids = {c.name: c.pid for c in self.init_containers + self.containers if c.pid is not None}
        if pids != self.last_pids:
            tmp = self.dir / ".pids.json.tmp"
            tmp.write_text(json.dumps(pids))
            tmp.replace(self.dir / "pids.json")
            self.last_pids = pids
