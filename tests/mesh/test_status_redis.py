"""`kvmesh status` reads Redis in bounded pieces: the pods set in pages, heartbeats and block-set
sizes in pipelined batches (never a round trip per pod), at most MAX_PODS pods per model."""

from __future__ import annotations

import redis

from kvmesh.common import redis_layout as rl
from kvmesh.mesh import status


def test_status_reads_in_batches_and_stops_at_its_limit(
    redis_server, model_name, capsys, monkeypatch
):
    r = redis_server.client()
    hb = rl.Heartbeat(pod="pod-a", url="http://10.0.0.1:8000", model=model_name)
    r.hset(rl.heartbeat_key(model_name, "pod-a"), mapping=hb.to_mapping())
    r.sadd(rl.blocks_key(model_name, "pod-a"), "00000000000000aa", "00000000000000bb")
    r.sadd(rl.pods_key(model_name), "pod-a", *[f"ghost-{i}" for i in range(1500)])
    round_trips = []
    real_execute = redis.client.Pipeline.execute

    def counting_execute(self, *a, **kw):
        round_trips.append(len(self.command_stack))
        return real_execute(self, *a, **kw)

    monkeypatch.setattr(redis.client.Pipeline, "execute", counting_execute)
    rows = status.collect(redis_server.url, model_name)
    assert len(rows) == 1501 and round_trips and max(round_trips) <= rl.READ_BATCH
    assert len(round_trips) <= 2 * -(
        -1501 // rl.READ_BATCH
    )  # heartbeats, then block-set sizes, per batch
    row = next(x for x in rows if x["pod"] == "pod-a")
    assert (row["state"], row["blocks_indexed"]) == ("ready", 2)
    assert {x["state"] for x in rows if x["pod"] != "pod-a"} == {"gone"}
    capsys.readouterr()
    some = status.collect(redis_server.url, model_name, max_pods=100)
    assert len(some) == 100
    assert "showing 100 of the 1501 pod names" in capsys.readouterr().err
    # every model, found with SCAN (the pods sets only)
    assert {x["model"] for x in status.collect(redis_server.url)} >= {model_name}
