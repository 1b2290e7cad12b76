"""Prometheus metrics with vLLM's names (contract 5).

Engine-side values (KV usage, queue lengths, cumulative token and prefix-cache
counters) are read from the engine thread's latest stats snapshot at scrape time by
a custom collector, so the engine loop pays nothing per step. Latency histograms and
request outcomes are observed on the HTTP side as outputs arrive.

prometheus_client appends ``_total`` to counters: ``vllm:prompt_tokens_total`` etc.
Each server gets its own registry (several servers can live in one test process).
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvmesh.common.kv_tiers import COST_METRIC
from kvmesh.engine.step_timing import PHASES

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class _EngineCollector:
    def __init__(self, engine, model_name: str, is_draining):
        self.engine = engine
        self.model_name = model_name
        self.is_draining = is_draining

    def collect(self):
        labels = ["model_name"]
        value = [self.model_name]
        s = self.engine.stats

        def gauge(name, doc, v):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(value, v)
            return g

        def counter(name, doc, v):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(value, v)
            return c

        yield gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage: 1 means 100 percent usage.",
            s.kv_cache_usage if s else 0.0,
        )
        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            s.num_running if s else 0,
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            s.num_waiting if s else 0,
        )
        yield gauge(
            "kvmesh:num_kv_blocks", "Total KV-cache blocks.", s.num_total_blocks if s else 0
        )
        yield gauge(
            "kvmesh:num_requests_in_flight",
            "Requests admitted by the server and not finished.",
            self.engine.num_in_flight,
        )
        yield gauge(
            "kvmesh:draining",
            "1 while the server drains after SIGTERM.",
            1.0 if self.is_draining() else 0.0,
        )
        args = self.engine.engine_args
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the KV-cache config.",
            labels=["block_size", "num_gpu_blocks", "enable_prefix_caching", "cache_dtype"],
        )
        info.add_metric(
            [
                str(args.block_size),
                str(s.num_total_blocks if s else 0),
                str(args.enable_prefix_caching),
                str(args.dtype),
            ],
            1.0,
        )
        yield info
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix-cache queries, in tokens.",
            s.prefix_cache_queries if s else 0,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix-cache hits, in tokens.",
            s.prefix_cache_hits if s else 0,
        )
        yield counter(
            "vllm:num_preemptions",
            "Cumulative number of preemptions.",
            s.num_preemptions if s else 0,
        )
        yield counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens if s else 0
        )
        yield counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            s.generation_tokens if s else 0,
        )
        failures = CounterMetricFamily(
            "kvmesh:engine_step_failures",
            "Engine failures: scope=request counts requests failed alone (the rest of their step went on); "
            "scope=batch counts steps that lost every request in them (the last resort).",
            labels=["model_name", "scope"],
        )
        for scope in ("request", "batch"):
            failures.add_metric(
                [self.model_name, scope], (s.step_failures.get(scope, 0) if s else 0)
            )
        yield failures
        # Debug: where the engine's steps spend their time (engine/step_timing.py).
        timing = getattr(self.engine, "step_timing", None) or {}
        for name, prefix, doc in (
            ("kvmesh:engine_step_phase_seconds", "", "Engine step time by phase (all steps)."),
            (
                "kvmesh:engine_decode_step_phase_seconds",
                "decode_",
                "Engine step time by phase, steps in which every request decoded one token.",
            ),
        ):
            fam = CounterMetricFamily(
                name, doc + " Phases: " + ", ".join(PHASES) + ".", labels=["model_name", "phase"]
            )
            for phase in PHASES:
                fam.add_metric([self.model_name, phase], timing.get(prefix + phase, 0.0))
            yield fam
        yield counter(
            "kvmesh:engine_timed_steps",
            "Engine steps that ran a batch (the phase counters' steps).",
            timing.get("steps", 0.0),
        )
        yield counter(
            "kvmesh:engine_decode_steps",
            "Engine steps in which every request decoded one token.",
            timing.get("decode_steps", 0.0),
        )
        yield counter(
            "kvmesh:engine_decode_step_seqs",
            "Requests in those decode steps (over the steps: the mean decode batch).",
            timing.get("decode_seqs", 0.0),
        )
        if args.speculative_config is not None:
            yield from self._spec_decode(s.spec_decode if s else None, counter)
        if s is not None and s.kv_tiers is not None:  # --kv-offloading-size / --kv-shared-dir
            yield from self._kv_tiers(s.kv_tiers)
        lora_info = getattr(self.engine, "lora_info", None)
        if lora_info is not None:  # --enable-lora
            yield lora_info.family()

    def _kv_tiers(self, tiers):
        """The KV tiers: what a block costs from each source, blocks held, tokens each served."""
        labels = ["model_name"]
        costs = GaugeMetricFamily(
            COST_METRIC,
            "Seconds per KV block: prefilling it (source=prefill), loading it from the host "
            "tier (CPU) or the shared tier (SHARED).",
            labels=[*labels, "source"],
        )
        for source, seconds in tiers.costs.items():
            costs.add_metric([self.model_name, source], seconds)
        yield costs
        blocks = GaugeMetricFamily(
            "kvmesh:kv_tier_blocks", "KV blocks each tier holds.", labels=[*labels, "medium"]
        )
        for medium, n in tiers.blocks.items():
            blocks.add_metric([self.model_name, medium], n)
        yield blocks
        hits = CounterMetricFamily(
            "kvmesh:kv_tier_hit_tokens",
            "Prompt tokens not computed, by the tier that held their KV.",
            labels=[*labels, "medium"],
        )
        for medium, n in tiers.hit_tokens.items():
            hits.add_metric([self.model_name, medium], n)
        yield hits

    def _spec_decode(self, sd, counter):
        """vLLM's speculative-decoding counters (only on an engine that speculates)."""
        yield counter(
            "vllm:spec_decode_num_drafts",
            "Number of spec decoding drafts.",
            sd.num_drafts if sd else 0,
        )
        yield counter(
            "vllm:spec_decode_num_draft_tokens",
            "Number of draft tokens.",
            sd.num_draft_tokens if sd else 0,
        )
        yield counter(
            "vllm:spec_decode_num_accepted_tokens",
            "Number of accepted tokens.",
            sd.num_accepted_tokens if sd else 0,
        )
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=["model_name", "position"],
        )
        for pos, n in enumerate(sd.accepted_per_pos if sd else []):
            per_pos.add_metric([self.model_name, str(pos)], n)
        yield per_pos
        yield counter(
            "kvmesh:spec_decode_steps_disabled_by_batch",
            "Steps without drafts because the batch reached disable_by_batch_size.",
            sd.num_steps_disabled_by_batch if sd else 0,
        )


class ServerMetrics:
    def __init__(self, engine, model_name: str, is_draining=lambda: False):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name, is_draining))
        r = self.registry
        ProcessCollector(
            registry=r
        )  # process_start_time_seconds: the sidecar detects engine restarts
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            ["model_name"],
            buckets=TTFT_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ["model_name"],
            buckets=ITL_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of end-to-end request latency in seconds.",
            ["model_name"],
            buckets=E2E_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.rejected = Counter(
            "kvmesh:requests_rejected",
            "Requests refused before reaching the engine.",
            ["model_name", "reason"],
            registry=r,
        )
        for reason in ("stop", "length", "abort"):
            self.success.labels(model_name, reason)

    def request_finished(self, reason: str | None) -> None:
        self.success.labels(self.model_name, reason or "abort").inc()

    def reject(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
