"""Free-port picking for the processes kvmesh up and the tests start: never the same port twice."""

import socket

from kvmesh.common import ports


def test_ports_are_distinct_and_outside_the_ephemeral_range():
    lo, hi = ports._ephemeral_range()
    picked = ports.free_ports(300)
    assert len(set(picked)) == len(picked)
    assert not any(lo <= p <= hi for p in picked)


def test_a_port_in_use_is_never_handed_out(monkeypatch):
    # Occupy a stretch of ports and force the scan to start on it.
    span = ports._candidates()
    held = []
    for port in span:
        if len(held) == 5:
            break
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            s.close()
            continue
        s.listen()
        held.append(s)
    taken = {s.getsockname()[1] for s in held}
    monkeypatch.setattr(ports._rng, "randrange", lambda n: 0)
    try:
        got = ports.free_port()
        assert got not in taken
        with socket.socket() as s:
            s.bind(("127.0.0.1", got))  # and it is really free
    finally:
        for s in held:
            s.close()
