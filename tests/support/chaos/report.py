"""The scenarios' reports: every figure, the invariants broken (`problems`) and printable `lines`."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvmesh_testing.chaos.load import Result


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))]


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms"


# -- chaos (faults.py) ------------------------------------------------------------------------------
@dataclass
class RoutingCheck:
    when: str
    probes: int = 0
    ok: int = 0
    same_pod: int = 0
    reasons: dict[str, int] = field(
        default_factory=dict
    )  # the router's routing decisions for the probes
    redis_errors: dict[str, int] = field(
        default_factory=dict
    )  # the router's failed Redis calls meanwhile, by op

    @property
    def prefix_match(self) -> int:
        return self.reasons.get("prefix_match", 0)

    def line(self) -> str:
        return (
            f"{self.when}: {self.same_pod}/{self.probes} follow-ups on the pod holding their prefix, "
            f"{self.prefix_match} routed by prefix match, {self.ok} ok"
        )


@dataclass
class RedisFault:
    name: str
    keys_before: int = 0  # block keys in Redis when it was killed
    keys_restored: int = 0  # block keys in Redis once the sidecars resynced
    keys_expected: int = 0  # blocks in the engines' caches then
    restored_after_s: float = 0.0  # from the restart until every key of before the kill is back
    served_while_down: int = 0
    results: list[Result] = field(default_factory=list)

    @property
    def failed(self) -> list[Result]:
        return [r for r in self.results if not r.ok]

    def line(self) -> str:
        down = (
            f", {self.served_while_down} requests served while it was down"
            if self.served_while_down
            else ""
        )
        return (
            f"(b) Redis {self.name} with {self.keys_before} block keys: {self.keys_restored}/{self.keys_expected} "
            f"keys restored by the sidecars (those of before the kill {self.restored_after_s:.2f} s after the "
            f"restart){down}; "
            f"{len(self.results)} requests, failed {len(self.failed)}"
        )


@dataclass
class ChaosReport:
    results: list[Result] = field(default_factory=list)
    # (a) an engine SIGKILLed mid-stream
    killed: str = ""
    t_kill: float = 0.0
    in_flight_on_killed: list[Result] = field(
        default_factory=list
    )  # client requests on it when it died
    lost: list[Result] = field(
        default_factory=list
    )  # every request of phase (a) that did not complete
    failed_after_fault: list[Result] = field(
        default_factory=list
    )  # started after the kill, did not complete
    failed_after_seen: list[Result] = field(
        default_factory=list
    )  # ... after the router dropped the replica
    seen_after_s: float = 0.0
    engine_back_s: float = 0.0
    # (b) Redis SIGKILLed and restarted (empty)
    redis: list[RedisFault] = field(default_factory=list)
    # (c) the router restarted (SIGTERM, then a new process on the same port)
    router_in_flight: int = 0
    router_in_flight_ok: int = 0
    router_refused: int = 0  # no router listening (connection refused or reset before any answer)
    router_failed: list[Result] = field(default_factory=list)
    router_exit_code: int | None = None  # None: still running when the harness gave up on it
    router_log_tail: str = ""  # the old router's last log lines, when it did not exit in time
    router_drain_s: float = 0.0
    router_back_s: float = 0.0
    # prefix routing before the faults, after Redis came back, after the router restarted
    routing: list[RoutingCheck] = field(default_factory=list)
    internal_errors: float = 0.0  # kvmesh_router_internal_errors_total, both router processes
    asgi_tracebacks: int = 0  # "Exception in ASGI application" / tracebacks in the router's log
    duration_s: float = 0.0
    timeline: list[tuple[str, float]] = field(
        default_factory=list
    )  # (what, seconds from the start)

    @property
    def sent(self) -> int:
        return len(self.results)

    @property
    def completed(self) -> int:
        return sum(r.ok for r in self.results)

    @property
    def hangs(self) -> list[Result]:
        return [r for r in self.results if r.kind == "hang"]

    @property
    def truncated(self) -> list[Result]:
        """Streams that ended without [DONE] or an error event, and 'ok' answers short of tokens."""
        return [
            r
            for r in self.results
            if r.kind in ("truncated", "malformed")
            or (r.ok and r.expected_tokens is not None and r.tokens != r.expected_tokens)
        ]

    @property
    def lost_on_killed(self) -> list[Result]:
        """Lost requests that were in flight on the killed engine when it died."""
        on = set(map(id, self.in_flight_on_killed))
        return [r for r in self.lost if id(r) in on]

    def problems(self) -> list[str]:
        """Every invariant the scenario must keep that it did not (the tests assert each one)."""
        out = []
        on = set(map(id, self.in_flight_on_killed))
        out += [
            f"lost a request not in flight on the killed engine: {r.short()}"
            for r in self.lost
            if id(r) not in on
        ]
        out += [
            f"lost without an error event or a 502: {r.short()}"
            for r in self.lost
            if not (r.kind == "error_event" or (r.kind == "http" and r.status == 502))
        ]
        out += [f"hung: {r.short()}" for r in self.hangs]
        out += [f"truncated: {r.short()}" for r in self.truncated]
        out += [f"failed after the fault: {r.short()}" for r in self.failed_after_fault]
        for f in self.redis:
            if f.keys_restored != f.keys_expected or f.keys_restored < f.keys_before:
                out.append(
                    f"Redis {f.name}: {f.keys_restored} keys restored, {f.keys_expected} expected "
                    f"(>= {f.keys_before})"
                )
            out += [f"failed around Redis {f.name}: {r.short()}" for r in f.failed]
        if self.router_in_flight_ok != self.router_in_flight:
            out.append(
                f"router restart: {self.router_in_flight - self.router_in_flight_ok} in-flight requests lost"
            )
        out += [f"failed around the router restart: {r.short()}" for r in self.router_failed]
        out += [
            f"routing {c.when}: {c.same_pod}/{c.probes} on their pod, reasons {c.reasons}"
            for c in self.routing
            if c.same_pod != c.probes or c.prefix_match != c.probes
        ]
        if self.internal_errors or self.asgi_tracebacks:
            out.append(
                f"router internal errors {self.internal_errors:g}, tracebacks {self.asgi_tracebacks}"
            )
        return out

    def lines(self) -> list[str]:
        kinds = Counter(f"{r.status} {r.kind}" if r.kind == "http" else r.kind for r in self.lost)
        mid = sum(r.tokens >= 1 for r in self.in_flight_on_killed)
        return [
            f"chaos: {self.sent} requests sent, {self.completed} completed, {len(self.hangs)} hung, "
            f"{len(self.truncated)} silently truncated ({self.duration_s:.1f} s)",
            f"  (a) engine {self.killed} SIGKILLed with {len(self.in_flight_on_killed)} requests on it ({mid} "
            f"mid-stream): {len(self.lost)} lost, {len(self.lost_on_killed)} of them on the killed engine "
            f"({', '.join(f'{v} {k}' for k, v in sorted(kinds.items())) or 'none'}); failed after the fault "
            f"{len(self.failed_after_fault)} ({len(self.failed_after_seen)} after the router dropped the replica, "
            f"{self.seen_after_s:.2f} s after the kill); restarted, routable again {self.engine_back_s:.1f} s "
            "after the kill",
            *(f"  {f.line()}" for f in self.redis),
            f"  (c) router restarted (SIGTERM, exit {self.router_exit_code}, drained in {self.router_drain_s:.2f} s, "
            f"back in {self.router_back_s:.1f} s): {self.router_in_flight_ok}/{self.router_in_flight} in-flight "
            f"requests completed, {self.router_refused} refused while no router listened, "
            f"failed {len(self.router_failed)}",
            *(f"  routing {c.line()}" for c in self.routing),
            f"  router internal errors {self.internal_errors:g}, ASGI tracebacks {self.asgi_tracebacks}",
            "  timeline: " + ", ".join(f"{what} {t:.1f}" for what, t in self.timeline),
        ]


# -- overload (overload.py) ------------------------------------------------------------------------
@dataclass
class Part:
    """One admission limit driven at `factor` x its capacity."""

    name: str
    capacity: int
    offered: int = 0  # concurrent clients, or requests sent at once
    results: list[Result] = field(default_factory=list)
    refusal: int = 429  # the documented answer over this limit
    seconds: float = 0.0

    @property
    def admitted(self) -> list[Result]:
        return [r for r in self.results if r.status == 200]

    @property
    def refused(self) -> list[Result]:
        return [r for r in self.results if r.status == self.refusal]

    @property
    def refused_without_retry_after(self) -> list[Result]:
        return [
            r for r in self.refused if not (r.retry_after or "").isdigit() or int(r.retry_after) < 1
        ]

    @property
    def server_errors(self) -> list[Result]:
        """5xx other than the documented refusal, and every answer that is neither admitted nor refused."""
        return [r for r in self.results if r.status not in (200, self.refusal)]

    @property
    def incomplete(self) -> list[Result]:
        """Admitted (200) but not completed: a stream without [DONE], an error event, short of tokens."""
        return [
            r
            for r in self.admitted
            if not r.ok or (r.expected_tokens is not None and r.tokens != r.expected_tokens)
        ]

    def line(self) -> str:
        lat = [r.latency for r in self.admitted if r.ok]
        return (
            f"{self.name}: capacity {self.capacity}, offered {self.offered} ({self.seconds:.1f} s): "
            f"{len(self.results)} sent, {len(self.admitted)} admitted "
            f"({len(self.admitted) - len(self.incomplete)} completed), {len(self.refused)} x {self.refusal} "
            f"({len(self.refused_without_retry_after)} without Retry-After), "
            f"{len(self.server_errors)} other (5xx, errors); admitted latency p50 {_ms(percentile(lat, 50))} "
            f"p99 {_ms(percentile(lat, 99))}"
        )


@dataclass
class OverloadReport:
    parts: list[Part] = field(default_factory=list)
    engine_max_admitted: list[int] = field(
        default_factory=list
    )  # most requests each engine held at once
    engine_capacity: int = 0
    internal_errors: float = 0.0
    asgi_tracebacks: int = 0
    duration_s: float = 0.0

    def part(self, name: str) -> Part:
        return next(p for p in self.parts if p.name.startswith(name))

    def problems(self) -> list[str]:
        out = []
        for p in self.parts:
            out += [f"{p.name}: not {p.refusal} nor 200: {r.short()}" for r in p.server_errors]
            out += [
                f"{p.name}: {p.refusal} without Retry-After: {r.short()}"
                for r in p.refused_without_retry_after
            ]
            out += [f"{p.name}: admitted, not completed: {r.short()}" for r in p.incomplete]
            if not p.admitted or not p.refused:
                out.append(
                    f"{p.name}: {len(p.admitted)} admitted, {len(p.refused)} refused (expected both)"
                )
        if any(m > self.engine_capacity for m in self.engine_max_admitted):
            out.append(f"an engine held more than its capacity: {self.engine_max_admitted}")
        if self.internal_errors or self.asgi_tracebacks:
            out.append(
                f"router internal errors {self.internal_errors:g}, tracebacks {self.asgi_tracebacks}"
            )
        return out

    def lines(self) -> list[str]:
        return [
            f"overload ({self.duration_s:.1f} s):",
            *(f"  {p.line()}" for p in self.parts),
            f"  engines held at most {self.engine_max_admitted} requests at once (capacity "
            f"{self.engine_capacity} each); router internal errors {self.internal_errors:g}, "
            f"ASGI tracebacks {self.asgi_tracebacks}",
        ]


# -- restarts under `kvmesh up` (up_restarts.py) ---------------------------------------------------
@dataclass
class UpRestart:
    """One part killed under load; what the clients saw and how long until it was routable."""

    name: str  # e.g. "engine SIGKILL"
    child: str  # the name `kvmesh up` gives it, e.g. "engine-0"
    pod: str | None  # the replica whose requests die with it (an engine), else None
    signal_name: str
    old_pid: int | None = None  # the killed process
    back_after_s: float | None = None  # from the kill until every replica is routable again
    results: list[Result] = field(default_factory=list)
    in_flight_at_kill: list[Result] = field(
        default_factory=list
    )  # on the killed process when it died
    sent_as_it_died: list[Result] = field(
        default_factory=list
    )  # engine: routed to it within KILL_RACE_S
    own: list[Result] = field(default_factory=list)  # failed, and the killed process's own
    refused_while_down: int = 0  # router: requests that found nothing listening
    keys_before: int = 0  # Redis: block keys when it was killed
    keys_restored: int = (
        0  # Redis: block keys once the load stopped (each set equal to its sidecar's index)
    )
    keys_back: bool | None = (
        None  # Redis: every key of before the kill in the sets then (unless evicted since)
    )
    restored_after_s: float | None = None  # Redis: until every sidecar rewrote its set
    exit_logged: str = ""  # the supervisor's line about the exit
    error: str = ""  # the scenario could not finish (ChaosError)

    @property
    def failed(self) -> list[Result]:
        return [r for r in self.results if not r.ok]

    @property
    def ok(self) -> int:
        return sum(r.ok for r in self.results)

    @property
    def failed_beyond(self) -> list[Result]:
        own = set(map(id, self.own))
        return [r for r in self.failed if id(r) not in own]

    def line(self) -> str:
        back = (
            "never routable again"
            if self.back_after_s is None
            else f"routable again {self.back_after_s:.1f} s after the kill"
        )
        extra = ""
        if self.pod:
            mid = sum(r.tokens >= 1 for r in self.in_flight_at_kill)
            extra = f", {len(self.in_flight_at_kill)} requests on it ({mid} mid-stream)"
            if self.sent_as_it_died:
                extra += f" and {len(self.sent_as_it_died)} sent to it as it died"
        elif self.child == "router":
            extra = (
                f", {len(self.in_flight_at_kill)} requests in flight on it, {self.refused_while_down} refused "
                "while it was down"
            )
        elif self.child == "redis":
            keys_at = (
                "never"
                if self.restored_after_s is None
                else f"{self.restored_after_s:.1f} s after the kill"
            )
            kept = {True: "all back", False: "not all back (evicted since?)", None: "-"}[
                self.keys_back
            ]
            extra = (
                f" with {self.keys_before} block keys, the sidecars' sets rewritten {keys_at} ({kept}; "
                f"{self.keys_restored} once the load stopped, each set equal to its sidecar's index)"
            )
        return (
            f"(up) {self.name}: {self.child} killed{extra}; {back}; {len(self.results)} requests sent, "
            f"{self.ok} ok, {len(self.failed)} failed, {len(self.failed_beyond)} failed beyond the killed "
            f"process's own" + (f"; ERROR {self.error.splitlines()[0]}" if self.error else "")
        )

    def problems(self) -> list[str]:
        out = [f"{self.name}: {self.error}"] if self.error else []
        if self.back_after_s is None and not self.error:
            out.append(f"{self.name}: never routable again")
        out += [
            f"{self.name}: failed beyond the killed process's own: {r.short()}"
            for r in self.failed_beyond
        ]
        out += [f"{self.name}: hung: {r.short()}" for r in self.results if r.kind == "hang"]
        return out


@dataclass
class UpRestartReport:
    scenarios: list[UpRestart] = field(default_factory=list)
    fresh_meshes: int = 0  # meshes started over because a scenario left the last one broken
    stop_exit: int | None = None  # `kvmesh up`'s exit status on SIGTERM at the end
    duration_s: float = 0.0

    def problems(self) -> list[str]:
        out = [p for s in self.scenarios for p in s.problems()]
        if self.stop_exit != 0:
            out.append(f"kvmesh up exited {self.stop_exit} on SIGTERM")
        return out

    def lines(self) -> list[str]:
        again = (
            f", {self.fresh_meshes} fresh meshes after a broken one" if self.fresh_meshes else ""
        )
        return [
            f"restarts under kvmesh up ({self.duration_s:.1f} s{again}; exit status on SIGTERM "
            f"{self.stop_exit}):",
            *(f"  {s.line()}" for s in self.scenarios),
        ]
