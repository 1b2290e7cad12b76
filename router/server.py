"""The router's HTTP server: uvicorn with a drain bounded by the router's own requests.

On SIGTERM (a rolling restart; the pod's preStop sleep has already let the Service drop it)
the router stops accepting connections, closes the idle keep-alive ones, answers anything
still arriving on an open connection with ``Connection: close``, and waits up to
``drain_timeout`` for the requests inside the router to finish. What is still streaming then
is cut: its engine response is closed (the engine stops the work) and the client gets an
error event and [DONE], never a silently truncated stream. Then it exits.

Plain uvicorn waits instead for every *connection* to close, up to its graceful timeout (a
client that stopped reading holds it all that time), and then for the app's clean-up with no
bound at all: the chaos test once saw a router that had drained everything still alive 20 s
later. Here the exit is decided by the requests in flight, which is what a restart must not
lose, and every step after them is bounded (the clean-up in Router.shutdown, the watchdog).
"""

from __future__ import annotations

import faulthandler
import logging

import uvicorn

log = logging.getLogger("kvmesh.router")

CUT_GRACE_S = 2.0  # after the drain: what is still being written gets this long, then it is cut
# After the drain timeout: the cut (2 s), uvicorn's wait (2 s) and the lifespan shutdown (3 steps
# of at most 2 s) are all bounded, together well below this.
WATCHDOG_AFTER_S = 15.0


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, router, drain_timeout: float, watchdog: bool):
        super().__init__(config)
        self.router = router
        self.drain_timeout = drain_timeout
        self.watchdog = watchdog

    async def shutdown(self, sockets=None) -> None:
        router = self.router
        if self.watchdog:
            # The last resort: a process still alive well after the drain and the cut dumps every
            # thread's stack to the log and exits, rather than outliving its grace period unexplained
            # (armed until the process ends: the interpreter's own exit comes after this method).
            faulthandler.dump_traceback_later(self.drain_timeout + WATCHDOG_AFTER_S, exit=True)
        router.drain.draining = True
        for server in self.servers:  # stop accepting
            server.close()
        for sock in sockets or []:
            sock.close()
        for conn in list(self.server_state.connections):
            conn.shutdown()  # idle: closed now; busy: closed after its response
        log.info(
            "draining: %d requests in flight, %d connections open (up to %.0fs)",
            len(router.drain.active),
            len(self.server_state.connections),
            self.drain_timeout,
        )
        if await router.drain.wait_drained(self.drain_timeout, lambda: self.force_exit):
            log.info("drained: every request finished")
        elif not self.force_exit:
            log.warning(
                "drain timeout (%.0fs): %d requests still in flight are cut: %s",
                self.drain_timeout,
                len(router.drain.active),
                router.drain.describe_active(),
            )
            router.cut()  # each stream ends with an error event and [DONE]
            await router.drain.wait_drained(CUT_GRACE_S, lambda: self.force_exit)
        # Then uvicorn's own shutdown: what is left (a client that stopped reading) gets
        # CUT_GRACE_S more and is cancelled; then the lifespan shutdown.
        await super().shutdown(sockets)


def make_server(
    router,
    host: str,
    port: int,
    drain_timeout: float,
    log_level: str = "warning",
    watchdog: bool = False,
) -> DrainingServer:
    """`watchdog`: the router is the whole process (the CLI), which may be ended by force."""
    config = uvicorn.Config(
        router,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=CUT_GRACE_S,
        loop="auto",
        http="auto",
    )
    return DrainingServer(config, router, drain_timeout, watchdog)
