"""Speculative decoding at the server: the CLI flags, vLLM's spec-decode metrics on /metrics,
and the acceptance rate on its way to `kvmesh status` (metrics -> sidecar heartbeat -> Redis)."""

from __future__ import annotations

import httpx
import pytest

from kvmesh.common import redis_layout as rl
from kvmesh.common.engine_load import engine_load, parse_prometheus
from tests.engine.server.conftest import ThreadServer, wait_for
from tests.tiny_models import build_tiny_model

SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "acceptance_threshold": 0}'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-v256"), "tiny-llama-v256"))


@pytest.fixture(scope="module")
def server(model_dir):
    srv = ThreadServer(
        [
            "--model",
            model_dir,
            "--served-model-name",
            "spec",
            "--num-kv-blocks",
            "64",
            "--speculative-config",
            SPEC,
            "--speculative-disable-by-batch-size",
            "8",
        ]
    ).start()
    yield srv
    srv.stop()


def test_metrics_have_vllms_spec_decode_counters(server):
    assert server.state.engine.engine_args.speculative_config.disable_by_batch_size == 8
    body = {
        "model": "spec",
        "prompt": list(range(3, 40)) * 2,
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    model = (("model_name", "spec"),)

    def scrape():  # the engine's stats snapshot is refreshed after each step
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        samples = {(n, tuple(sorted(lab.items()))): v for n, lab, v in parse_prometheus(text)}
        return (
            (text, samples) if samples.get(("vllm:spec_decode_num_drafts_total", model)) else None
        )

    text, samples = wait_for(scrape)
    truth = server.state.engine.stats.spec_decode  # the snapshot the collector reads
    assert truth.num_drafts > 0 and truth.num_accepted_tokens > 0
    assert samples[("vllm:spec_decode_num_drafts_total", model)] <= truth.num_drafts
    text, samples = wait_for(
        lambda: (
            (r := scrape())
            and r[1][("vllm:spec_decode_num_drafts_total", model)]
            == server.state.engine.stats.spec_decode.num_drafts
            and r
        )
    )
    truth = server.state.engine.stats.spec_decode
    assert samples[("vllm:spec_decode_num_drafts_total", model)] == truth.num_drafts
    assert samples[("vllm:spec_decode_num_draft_tokens_total", model)] == truth.num_draft_tokens
    assert (
        samples[("vllm:spec_decode_num_accepted_tokens_total", model)] == truth.num_accepted_tokens
    )
    assert truth.num_drafts <= truth.num_draft_tokens <= 3 * truth.num_drafts
    per_pos = {
        dict(lab)["position"]: v
        for (n, lab), v in samples.items()
        if n == "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    }
    assert per_pos == {str(i): float(n) for i, n in enumerate(truth.accepted_per_pos)}
    assert (
        per_pos["0"] >= per_pos["1"] >= per_pos["2"]
        and sum(per_pos.values()) == truth.num_accepted_tokens
    )
    # The sidecar's reading of the same page, and the heartbeat that carries it to `kvmesh status`.
    load = engine_load(text)
    assert (load.spec_draft_tokens, load.spec_accepted_tokens) == (
        truth.num_draft_tokens,
        truth.num_accepted_tokens,
    )
    hb = rl.Heartbeat(
        pod="p",
        url="http://x",
        model="spec",
        spec_draft_tokens=load.spec_draft_tokens,
        spec_accepted_tokens=load.spec_accepted_tokens,
    )
    back = rl.Heartbeat.from_mapping("p", hb.to_mapping())
    assert back.spec_accepted_tokens / back.spec_draft_tokens == pytest.approx(
        truth.num_accepted_tokens / truth.num_draft_tokens
    )


def test_no_spec_metrics_without_speculation():
    text = 'vllm:num_requests_running{model_name="m"} 1.0\n'
    load = engine_load(text)
    assert load.spec_draft_tokens == 0
    mapping = rl.Heartbeat(pod="p", url="http://x", model="m").to_mapping()
    assert rl.F_SPEC_DRAFT not in mapping  # an engine that does not speculate adds no fields


def test_status_shows_the_acceptance_rate(redis_server, model_name, capsys):
    import redis

    from kvmesh.mesh import status

    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    hb = rl.Heartbeat(
        pod="pod-a",
        url="http://10.0.0.1:8000",
        model=model_name,
        spec_draft_tokens=200,
        spec_accepted_tokens=150,
    )
    r.hset(rl.heartbeat_key(model_name, "pod-a"), mapping=hb.to_mapping())
    r.sadd(rl.pods_key(model_name), "pod-a")
    rows = status.collect(redis_server.url, model_name)
    assert rows[0]["spec_acceptance_rate"] == pytest.approx(0.75)
    import argparse

    args = argparse.Namespace(
        redis_url=redis_server.url, model=model_name, state_file="/nonexistent", json=False
    )
    assert status.run(args) == 0
    out = capsys.readouterr().out
    assert "SPEC ACCEPT" in out and "75%" in out


@pytest.mark.parametrize(
    "argv, field",
    [
        (
            ["--speculative-config", '{"method": "ngram"}'],
            "speculative_config.num_speculative_tokens",
        ),
        (
            ["--speculative-config", '{"method": "medusa", "num_speculative_tokens": 2}'],
            "speculative_config.method",
        ),
        (["--speculative-config", "{oops"], "speculative_config"),
        (["--speculative-disable-by-batch-size", "0"], "--speculative-disable-by-batch-size"),
    ],
)
def test_bad_flags_are_cli_errors_naming_the_field(argv, field, capsys):
    from kvmesh.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", *argv])
    assert exit_.value.code == 2
    assert field in capsys.readouterr().err


def test_batch_size_flag_needs_a_config(capsys):
    from kvmesh.cli import main

    assert main(["generate", "--speculative-disable-by-batch-size", "4", "hi"]) == 2
    assert "--speculative-disable-by-batch-size" in capsys.readouterr().err


def test_llm_rejects_a_bad_config_naming_the_field(model_dir):
    from kvmesh.engine import LLM

    with pytest.raises(ValueError, match=r"speculative_config\.prompt_lookup_min"):
        LLM(
            model_dir,
            speculative_config={
                "num_speculative_tokens": 2,
                "prompt_lookup_max": 2,
                "prompt_lookup_min": 3,
            },
        )
