"""Free loopback ports for processes we start ourselves (`kvmesh up`, the tests).

The usual trick - bind port 0, read the port, close - has two races when a caller
picks several ports before any child binds them:

* the kernel may hand the same just-closed port out again, so two children of one
  batch (an engine's HTTP port and another's ZMQ port, say) are told the same port;
* bind(0) draws from the ephemeral range, which the outgoing connections of every
  client on the machine draw from too, so a port can be taken before the child binds.

So ports come from below the ephemeral range, are checked bindable, and are never
handed out twice by one process. The scan starts at a per-process random offset, so
two processes picking at the same time are unlikely to meet either.
"""

from __future__ import annotations

import os
import random
import socket
import threading

_LOWEST = 20000
_lock = threading.Lock()
_handed_out: set[int] = set()
_rng = random.Random(os.getpid() ^ int.from_bytes(os.urandom(4), "little"))


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
            return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(port: int, host: str) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _candidates() -> range:
    lo, hi = _ephemeral_range()
    if lo - _LOWEST >= 1000:
        return range(_LOWEST, lo)
    return range(hi + 1, 65536) if 65535 - hi >= 1000 else range(1024, 65536)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now and that this process has not handed out before."""
    with _lock:
        span = _candidates()
        start = _rng.randrange(len(span))
        for i in range(len(span)):
            port = span[(start + i) % len(span)]
            if port not in _handed_out and _bindable(port, host):
                _handed_out.add(port)
                return port
        # Everything outside the ephemeral range is taken: let the kernel choose.
        while True:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in _handed_out:
                _handed_out.add(port)
                return port


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct free ports."""
    return [free_port(host) for _ in range(n)]
