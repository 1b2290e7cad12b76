"""A stand-in container for the local cluster's tests: an HTTP server on $PORT (default 8000)
whose readiness and health a test flips over HTTP.

GET /ready, /health: 200 or 503 as set; GET /set?ready=0|1&healthy=0|1 sets them;
GET /whoami: hostname and pod IP; GET /file?path=P: the file's text; GET /env?name=N: a variable.
IGNORE_TERM=1: SIGTERM is logged and ignored (the kubelet's SIGKILL must end it).
"""

import json
import os
import signal
import socket
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

state = {"ready": os.environ.get("START_READY", "1") == "1", "healthy": True}


def on_term(signum, frame):
    print("got SIGTERM", flush=True)
    if os.environ.get("IGNORE_TERM") != "1":
        sys.exit(0)


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def reply(self, code: int, body: str) -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        url = urlparse(self.path)
        q = {k: v[0] for k, v in parse_qs(url.query).items()}
        if url.path == "/ready":
            self.reply(200 if state["ready"] else 503, "ready" if state["ready"] else "not ready")
        elif url.path == "/health":
            self.reply(200 if state["healthy"] else 500, "ok" if state["healthy"] else "broken")
        elif url.path == "/set":
            for key in ("ready", "healthy"):
                if key in q:
                    state[key] = q[key] == "1"
            self.reply(200, json.dumps(state))
        elif url.path == "/whoami":
            self.reply(
                200,
                json.dumps(
                    {"hostname": socket.gethostname(), "pod_ip": os.environ.get("POD_IP", "")}
                ),
            )
        elif url.path == "/file":
            try:
                with open(q["path"]) as f:
                    self.reply(200, f.read())
            except OSError as exc:
                self.reply(404, str(exc))
        elif url.path == "/env":
            self.reply(200, os.environ.get(q["name"], ""))
        else:
            self.reply(404, "no such path")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, on_term)
    port = int(os.environ.get("PORT", "8000"))
    server = ThreadingHTTPServer(("0.0.0.0", port), Handler)
    print(f"listening on :{port}", flush=True)
    server.serve_forever()
