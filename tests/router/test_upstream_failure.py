"""Every engine failure before the client got anything is answered by one function, from one table:
the status, error code, metric stage and Outcome error each failure names."""

import asyncio
import json

import pytest

from kvmesh.router import app
from kvmesh.router import upstream_failure as uf

EXPECTED = [  # failure, status, code, stage, Outcome.error
    (uf.TIMEOUT, 504, None, "before_response", "timeout"),
    (uf.DISCONNECTED, 502, "upstream_disconnected", "before_response", "disconnected"),
    (uf.BODY, 502, "upstream_failed", "body", "body"),
    (uf.FIRST_EVENT, 502, "upstream_failed", "before_response", "before_first_event"),
]


def _answer(router, failure):
    sent = []

    async def send(msg):
        sent.append(msg)

    out = asyncio.run(
        router.proxy.upstream_failed(
            send, failure, OSError("reset"), "pod-0", "rid-1", 1, [(b"x-kvmesh-pod", b"pod-0")]
        )
    )
    return out, sent


@pytest.mark.parametrize("failure,status,code,stage,error", EXPECTED)
def test_each_failure_answers_as_its_row_says(failure, status, code, stage, error):
    router = app.Router(app.RouterConfig(redis_url=None), encoder=object())
    before = router.metrics.upstream_failures.labels(stage)._value.get()
    out, sent = _answer(router, failure)
    assert (out.status, out.pod, out.error, out.attempts) == (status, "pod-0", error, 1)
    assert sent[0]["status"] == status and (b"x-kvmesh-pod", b"pod-0") in sent[0]["headers"]
    body = json.loads(sent[1]["body"])
    assert body["error"]["code"] == code and body["error"]["message"] == failure.message
    assert router.metrics.upstream_failures.labels(stage)._value.get() == before + 1


@pytest.mark.parametrize("failure", [uf.BODY, uf.FIRST_EVENT])
def test_a_failure_during_the_routers_own_cut_is_a_shutdown_answer(failure):
    router = app.Router(app.RouterConfig(redis_url=None), encoder=object())
    router.drain.cutting = True
    out, sent = _answer(router, failure)
    assert (out.status, out.error) == (503, "router_shutdown")
    assert json.loads(sent[1]["body"])["error"]["code"] == "router_shutdown"
