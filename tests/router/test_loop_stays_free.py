"""A real `kvmesh router` keeps answering /health, /ready and /metrics within milliseconds while
four ~4 MB requests pass through it at once (a text completion, a chat, a token-id list, a
/tokenize): their JSON, checks, tokenisation and block keys run off its event loop. The engine
behind it is the stub, told not to tokenize, so the router's own work is what is measured."""

from __future__ import annotations

from tests.loop_probe import big_bodies, check_latencies, probe_during
from tests.router.test_drain import RouterProc


def test_probes_stay_fast_under_four_4mb_requests(stub_factory, model_name, tmp_path):
    (stub,) = stub_factory(model_name, 1, "--no-tokenize", "--response-tokens", "1", events=False)
    with RouterProc(stub.url, tmp_path) as router:
        latencies, failures, answers = probe_during(
            router.url, ("/health", "/ready", "/metrics"), big_bodies()
        )
    # the generations went through (the stub, told not to tokenize, cannot answer /tokenize)
    assert [status for path, status, _ in answers if path != "/tokenize"] == [200] * 3, answers
    assert not failures, failures
    check_latencies(latencies)
