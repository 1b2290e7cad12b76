"""The Service forwarder (kube-proxy's job, in user space): each ClusterIP Service's address is
added to the cluster's bridge in the host's network namespace, and a TCP proxy listens on
each of its ports, forwarding every connection to one of the Service's ready endpoints
(round-robin) from its EndpointSlices. The ``kubernetes`` Service forwards to the API
server's loopback port. Pods reach ClusterIPs through the bridge; the test process reaches
them directly.

``python -m kvmesh_testing.node.services --kubeconfig K --slot N --apiserver-port P``
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import signal
import threading
from pathlib import Path
from typing import Any

from kvmesh_testing.node import network
from kvmesh_testing.node.api import Api, Informer
from kvmesh_testing.node.lifeline import watch_parent

log = logging.getLogger("kvmesh_testing.services")
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


class Forwarder:
    def __init__(self, api: Api, net: network.NetworkConfig, apiserver_port: int) -> None:
        self.api, self.net, self.apiserver_port = api, net, apiserver_port
        self.changed = threading.Event()
        self.services = Informer(api, "/api/v1/services", on_event=lambda *_: self.changed.set())
        self.slices = Informer(
            api, "/apis/discovery.k8s.io/v1/endpointslices", on_event=lambda *_: self.changed.set()
        )
        self.listeners: dict[
            tuple[str, int], tuple[asyncio.base_events.Server, str, str, dict[str, Any]]
        ] = {}
        self.addresses: set[str] = set()
        self.round_robin: dict[tuple[str, str, str], itertools.count] = {}

    # --- endpoints -----------------------------------------------------------------------------

    def backends(self, namespace: str, service: str, port: dict[str, Any]) -> list[tuple[str, int]]:
        if (namespace, service) == ("default", "kubernetes"):
            return [("127.0.0.1", self.apiserver_port)]
        out = []
        for s in self.slices.items():
            meta = s["metadata"]
            if (
                meta.get("namespace") != namespace
                or (meta.get("labels") or {}).get(SERVICE_NAME_LABEL) != service
            ):
                continue
            number = next(
                (
                    p.get("port")
                    for p in s.get("ports") or []
                    if (p.get("name") or "") == (port.get("name") or "")
                ),
                None,
            )
            if number is None:
                continue
            for ep in s.get("endpoints") or []:
                if (ep.get("conditions") or {}).get("ready", True) is False:
                    continue
                out += [(addr, int(number)) for addr in ep.get("addresses") or []]
        return sorted(set(out))

    def pick(self, namespace: str, service: str, port: dict[str, Any]) -> tuple[str, int] | None:
        backends = self.backends(namespace, service, port)
        if not backends:
            return None
        counter = self.round_robin.setdefault(
            (namespace, service, str(port.get("port"))), itertools.count()
        )
        return backends[next(counter) % len(backends)]

    # --- proxying ------------------------------------------------------------------------------

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            try:
                if writer.can_write_eof():
                    writer.write_eof()
            except (OSError, RuntimeError):
                pass

    def _handler(self, namespace: str, service: str, port: dict[str, Any]):
        async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
            backend = self.pick(namespace, service, port)
            try:
                if backend is None:
                    return  # no ready endpoint: the connection is refused (closed at once)
                try:
                    up_r, up_w = await asyncio.wait_for(
                        asyncio.open_connection(*backend), timeout=5
                    )
                except (TimeoutError, OSError) as exc:
                    log.info(
                        "%s/%s:%s -> %s: %s", namespace, service, port.get("port"), backend, exc
                    )
                    return
                try:
                    await asyncio.gather(self._pipe(client_r, up_w), self._pipe(up_r, client_w))
                finally:
                    up_w.close()
            finally:
                client_w.close()

        return handle

    # --- reconciling ---------------------------------------------------------------------------

    def desired(self) -> dict[tuple[str, int], tuple[str, str, dict[str, Any]]]:
        want = {}
        for svc in self.services.items():
            ip = svc["spec"].get("clusterIP")
            if not ip or ip == "None":
                continue
            for port in svc["spec"].get("ports") or []:
                if port.get("protocol", "TCP") == "TCP":
                    want[(ip, int(port["port"]))] = (
                        svc["metadata"]["namespace"],
                        svc["metadata"]["name"],
                        port,
                    )
        return want

    async def reconcile(self) -> None:
        want = self.desired()
        for key in [
            k
            for k, (_, ns, name, port) in self.listeners.items()
            if want.get(k) is None or want[k][:2] != (ns, name)
        ]:
            server = self.listeners.pop(key)[0]
            server.close()
        for key, (ns, name, port) in want.items():
            if key in self.listeners:
                self.listeners[key] = (
                    self.listeners[key][0],
                    ns,
                    name,
                    port,
                )  # target port changes
                continue
            ip = key[0]
            if ip not in self.addresses:
                network.ip("addr", "replace", f"{ip}/32", "dev", self.net.bridge)
                self.addresses.add(ip)
            try:
                server = await asyncio.start_server(
                    self._dispatch(key), host=ip, port=key[1], reuse_address=True
                )
            except OSError as exc:
                log.warning("cannot listen on %s:%s for %s/%s: %s", ip, key[1], ns, name, exc)
                continue
            self.listeners[key] = (server, ns, name, port)
        in_use = {k[0] for k in self.listeners}
        for ip in self.addresses - in_use:
            network.ip("addr", "del", f"{ip}/32", "dev", self.net.bridge, check=False)
            self.addresses.discard(ip)

    def _dispatch(self, key: tuple[str, int]):
        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            entry = self.listeners.get(key)
            if entry is None:
                w.close()
                return
            _, ns, name, port = entry
            await self._handler(ns, name, port)(r, w)

        return handle

    async def run(self, stop: asyncio.Event) -> None:
        self.services.start()
        self.slices.start()
        while not stop.is_set():
            if self.changed.is_set():
                self.changed.clear()
                await self.reconcile()
            try:
                await asyncio.wait_for(stop.wait(), timeout=0.1)
            except TimeoutError:
                pass
        for server, *_ in self.listeners.values():
            server.close()
        self.services.stop()
        self.slices.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m kvmesh_testing.node.services", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--kubeconfig", type=Path, required=True)
    p.add_argument("--slot", type=int, required=True)
    p.add_argument("--apiserver-port", type=int, required=True)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        watch_parent(
            lambda: loop.call_soon_threadsafe(stop.set)
        )  # go when the cluster's process is gone
        forwarder = Forwarder(
            Api(args.kubeconfig), network.NetworkConfig(args.slot), args.apiserver_port
        )
        await forwarder.run(stop)

    asyncio.run(run())


if __name__ == "__main__":
    main()
