"""The part of the kubelet's HTTPS API that ``kubectl logs`` needs: the API server proxies
``pods/log`` to ``https://<node InternalIP>:<kubeletEndpoint port>/containerLogs/<ns>/<pod>/<container>``
(``previous``, ``tailLines``, ``follow``). Listens on the bridge's address only; the certificate
is a throwaway self-signed one (the API server does not verify kubelet certificates unless told
to)."""

from __future__ import annotations

import ssl
import subprocess
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

LogDir = Callable[[str, str], Path | None]  # (namespace, pod) -> its containers' log directory


def _self_signed(directory: Path, address: str) -> tuple[Path, Path]:
    cert, key = directory / "kubelet.crt", directory / "kubelet.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "2",
            "-subj",
            "/CN=kvmesh-node",
            "-addext",
            f"subjectAltName=IP:{address}",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def _tail(text: str, lines: int | None) -> str:
    if lines is None:
        return text
    kept = text.splitlines(keepends=True)
    return "".join(kept[-lines:]) if lines > 0 else ""


class KubeletApi:
    def __init__(self, address: str, state_dir: Path, log_dir: LogDir) -> None:
        self.log_dir = log_dir
        self.stopping = threading.Event()
        cert, key = _self_signed(state_dir, address)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        handler = self._handler()
        self.server = ThreadingHTTPServer((address, 0), handler)
        self.server.daemon_threads = True
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(
            target=self.server.serve_forever, name="kubelet-api", daemon=True
        )

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.server.shutdown()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                url = urlparse(self.path)
                parts = url.path.strip("/").split("/")
                if parts == ["healthz"]:
                    return self._send(200, b"ok")
                if len(parts) != 4 or parts[0] != "containerLogs":
                    return self._send(
                        404, b"not served by the local node agent (only containerLogs)"
                    )
                _, ns, pod, container = parts
                q = {k: v[0] for k, v in parse_qs(url.query).items()}
                directory = api.log_dir(ns, pod)
                previous = q.get("previous") == "true"
                path = (
                    directory / f"{container}.{'previous.' if previous else ''}log"
                    if directory
                    else None
                )
                if path is None or not path.exists():
                    return self._send(
                        404,
                        f"no {'previous ' if previous else ''}log of {ns}/{pod}/{container}".encode(),
                    )
                tail = int(q["tailLines"]) if q.get("tailLines", "").lstrip("-").isdigit() else None
                text = _tail(path.read_text(errors="replace"), tail)
                if q.get("follow") != "true":
                    return self._send(200, text.encode())
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                self._follow(path, text)

            def _follow(self, path: Path, first: str) -> None:
                try:
                    self.wfile.write(first.encode())
                    self.wfile.flush()
                    position = path.stat().st_size
                    inode = path.stat().st_ino
                    while not api.stopping.is_set():
                        time.sleep(0.2)
                        if not path.exists() or path.stat().st_ino != inode:
                            return  # the container restarted: this run's log is complete
                        with path.open("rb") as f:
                            f.seek(position)
                            chunk = f.read()
                        if chunk:
                            position += len(chunk)
                            self.wfile.write(chunk)
                            self.wfile.flush()
                except (BrokenPipeError, ConnectionError, OSError):
                    return

            def _send(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return Handler
