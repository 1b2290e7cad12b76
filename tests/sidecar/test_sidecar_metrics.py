"""The sidecar's /metrics names and types are a contract (dashboards and tests read them): the
prometheus_client exposition keeps every one, and shows the live counters at each scrape."""

from kvmesh.common.engine_load import parse_prometheus
from kvmesh.sidecar.service import Sidecar, SidecarConfig

COUNTERS = [
    f"kvmesh_sidecar_kv_event_{k}_total"
    for k in (
        "batches",
        "decode_errors",
        "lost_batches",
        "gaps",
        "gap_batches",
        "snapshots",
        "gap_resets",
        "replay_failures",
        "replays",
        "resets",
    )
] + [
    f"kvmesh_sidecar_{k}_total"
    for k in (
        "events_loop_errors",
        "redis_errors",
        "full_rewrites",
        "heartbeats",
        "engine_restarts",
        "index_withdrawals",
        "block_set_repairs",
        "events_unknown_medium",
    )
]
GAUGES = [
    "kvmesh_sidecar_block_keys",
    "kvmesh_sidecar_events_ok",
    "kvmesh_sidecar_events_loop_age_seconds",
]


def _types(text: str) -> dict[str, str]:
    return {
        line.split()[2]: line.split()[3] for line in text.splitlines() if line.startswith("# TYPE ")
    }


def test_every_metric_keeps_its_name_and_type():
    sc = Sidecar(
        SidecarConfig(pod_name="pod-a", pod_url="http://127.0.0.1:1")
    )  # not started: no I/O
    text = sc.metrics_text()
    assert _types(text) == {**{n: "counter" for n in COUNTERS}, **{n: "gauge" for n in GAUGES}}
    samples = {name: value for name, labels, value in parse_prometheus(text) if not labels}
    assert set(samples) == set(COUNTERS) | set(GAUGES)
    assert samples["kvmesh_sidecar_events_loop_age_seconds"] == -1  # no iteration yet
    assert samples["kvmesh_sidecar_events_ok"] == 0  # not started


def test_a_scrape_reads_the_counters_as_they_are_now():
    sc = Sidecar(SidecarConfig(pod_name="pod-a", pod_url="http://127.0.0.1:1"))
    sc.stats["heartbeats"] += 3
    sc.stats["redis_errors"] += 1
    samples = {name: value for name, _, value in parse_prometheus(sc.metrics_text())}
    assert samples["kvmesh_sidecar_heartbeats_total"] == 3
    assert samples["kvmesh_sidecar_redis_errors_total"] == 1
    assert samples["kvmesh_sidecar_full_rewrites_total"] == 0
