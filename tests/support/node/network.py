"""Pod networking: a bridge in the host's network namespace, one network namespace per pod
joined to it by a veth pair, pod IPs from a private /24 (like a CNI bridge plugin).

Everything a cluster creates carries its slot number in its name (``kvmbr<slot>``,
``kvm<slot>p<n>``, ``kvm<slot>h<n>``), so a cluster starting in a slot can remove what a
crashed earlier run left there. Pods get routes to the pod /24 and to the Service range
(through the bridge's address) and no default route: traffic stays inside the harness's
namespaces and the host's bridge addresses.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import threading
from dataclasses import dataclass


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


@dataclass(frozen=True)
class NetworkConfig:
    slot: int

    @property
    def bridge(self) -> str:
        return f"kvmbr{self.slot}"

    @property
    def pod_cidr(self) -> str:
        return f"10.244.{self.slot}.0/24"

    @property
    def gateway(self) -> str:
        """The bridge's address: the node's IP, and the pods' way to Service IPs."""
        return f"10.244.{self.slot}.1"

    @property
    def service_cidr(self) -> str:
        return f"10.96.{self.slot}.0/24"

    @property
    def apiserver_service_ip(self) -> str:
        """The first address of the Service range: the ``kubernetes`` Service's ClusterIP."""
        return str(ipaddress.ip_network(self.service_cidr)[1])

    def netns(self, n: int) -> str:
        return f"kvm{self.slot}p{n}"

    def host_veth(self, n: int) -> str:
        return f"kvm{self.slot}h{n}"

    def owns_netns(self, name: str) -> bool:
        return name.startswith(f"kvm{self.slot}p")


def _netns_names() -> list[str]:
    out = ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def remove_leftovers(cfg: NetworkConfig) -> list[str]:
    """Remove this slot's pod namespaces (killing what still runs in them), veths and bridge."""
    removed = []
    for name in _netns_names():
        if not cfg.owns_netns(name):
            continue
        for pid in ip("netns", "pids", name, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        ip("netns", "del", name, check=False)
        removed.append(f"netns {name}")
    for line in ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name == cfg.bridge or name.startswith(f"kvm{cfg.slot}h"):
            ip("link", "del", name, check=False)
            removed.append(f"link {name}")
    return removed


def ranges_in_use() -> list[ipaddress.IPv4Network]:
    """The IPv4 networks the host's routes cover, except the local clusters' own bridges'
    (a slot's lock says whether those are in use)."""
    nets = []
    for line in ip("-4", "route", "show", "table", "all", check=False).stdout.splitlines():
        fields = line.split()
        if not fields or " dev kvmbr" in line or fields[0] in ("broadcast", "local", "unreachable"):
            continue
        dest = fields[0]
        if dest == "default":
            continue
        try:
            nets.append(ipaddress.ip_network(dest, strict=False))
        except ValueError:
            pass
    return nets


def conflicts(cfg: NetworkConfig) -> list[str]:
    """The host routes that overlap this slot's pod or Service range (such a slot is skipped:
    the cluster would shadow real networks, e.g. on a CI runner that is itself a pod)."""
    ours = [ipaddress.ip_network(cfg.pod_cidr), ipaddress.ip_network(cfg.service_cidr)]
    return [str(net) for net in ranges_in_use() if any(net.overlaps(o) for o in ours)]


def create_bridge(cfg: NetworkConfig) -> None:
    remove_leftovers(cfg)
    ip("link", "add", cfg.bridge, "type", "bridge")
    ip("addr", "add", f"{cfg.gateway}/24", "dev", cfg.bridge)
    ip("link", "set", cfg.bridge, "up")


def delete_bridge(cfg: NetworkConfig) -> None:
    remove_leftovers(cfg)


class PodIPs:
    """Pod addresses .2-.254 of the /24, handed out round-robin so an address just freed is
    not reused at once (a stale endpoint then points nowhere rather than at another pod)."""

    def __init__(self, cfg: NetworkConfig) -> None:
        self.cfg = cfg
        self.used: set[int] = set()
        self.cursor = 1
        self.lock = threading.Lock()

    def allocate(self) -> int:
        with self.lock:
            for _ in range(253):
                self.cursor = self.cursor + 1 if self.cursor < 254 else 2
                if self.cursor not in self.used:
                    self.used.add(self.cursor)
                    return self.cursor
        raise RuntimeError("no free pod IP on this node")

    def release(self, n: int) -> None:
        with self.lock:
            self.used.discard(n)


def pod_ip(cfg: NetworkConfig, n: int) -> str:
    return f"10.244.{cfg.slot}.{n}"


def setup_pod_network(cfg: NetworkConfig, n: int) -> str:
    """A network namespace with loopback and eth0 = pod_ip(cfg, n)/24 on the bridge; its path."""
    ns, host, peer = cfg.netns(n), cfg.host_veth(n), f"kvm{cfg.slot}c{n}"
    teardown_pod_network(cfg, n)
    ip("netns", "add", ns)
    ip("link", "add", host, "type", "veth", "peer", "name", peer)
    ip("link", "set", peer, "netns", ns)
    ip("link", "set", host, "master", cfg.bridge)
    ip("link", "set", host, "up")
    ip("-n", ns, "link", "set", peer, "name", "eth0")
    ip("-n", ns, "addr", "add", f"{pod_ip(cfg, n)}/24", "dev", "eth0")
    ip("-n", ns, "link", "set", "lo", "up")
    ip("-n", ns, "link", "set", "eth0", "up")
    ip("-n", ns, "route", "add", cfg.service_cidr, "via", cfg.gateway)
    return f"/run/netns/{ns}"


def teardown_pod_network(cfg: NetworkConfig, n: int) -> None:
    ip("netns", "del", cfg.netns(n), check=False)
    ip("link", "del", cfg.host_veth(n), check=False)
