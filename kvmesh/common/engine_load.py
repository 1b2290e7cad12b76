"""Reading an engine's Prometheus `/metrics` (vLLM names) into one load figure, for the sidecar, router and operator."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from kvmesh.common.kv_tiers import COST_METRIC, COST_SOURCES, MEDIUM_CPU, MEDIUM_SHARED

# The engine's gauge of the blocks each of its tiers holds (label ``medium``).
TIER_BLOCKS_METRIC = "kvmesh:kv_tier_blocks"

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass
class EngineLoad:
    kv_usage: float = 0.0
    running: int = 0
    waiting: int = 0
    total_blocks: int = 0
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    spec_draft_tokens: float = 0.0  # speculative decoding: draft tokens verified, and accepted
    spec_accepted_tokens: float = 0.0
    process_start_time: float | None = None
    block_size: int | None = None  # vLLM's, from cache_config_info (a check against the sidecar's)
    # LoRA, from vllm:lora_requests_info (absent: an engine serving no adapters)
    max_loras: int = 0
    active_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()
    lora_info_time: float = -1.0  # the newest lora_requests_info sample's value (its time)
    # KV tiers (kvmesh/common/kv_tiers.py): the COST_METRIC samples by heartbeat field (empty:
    # none published), the host tier's size in blocks (0: none), a shared tier (on or off)
    tier_costs: dict[str, float] = field(default_factory=dict)
    host_blocks: int = 0
    shared_tier: bool = False


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        if not math.isfinite(value):
            continue  # NaN/Inf: no usable figure (and int() of it would raise)
        labels = dict(_LABEL.findall(m.group(3) or ""))
        samples.append((m.group(1), labels, value))
    return samples


def engine_load(text: str) -> EngineLoad:
    """Sum each metric over its label sets (several engines/DP ranks may share one endpoint)."""
    load = EngineLoad()
    usage: list[float] = []
    for name, labels, value in parse_prometheus(text):
        if name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
            usage.append(value)
        elif name == "vllm:num_requests_running":
            load.running += int(value)
        elif name == "vllm:num_requests_waiting":
            load.waiting += int(value)
        elif name in (
            "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_queries",
            "vllm:gpu_prefix_cache_queries_total",
        ):
            load.prefix_cache_queries += value
        elif name in (
            "vllm:prefix_cache_hits_total",
            "vllm:prefix_cache_hits",
            "vllm:gpu_prefix_cache_hits_total",
        ):
            load.prefix_cache_hits += value
        elif name in (
            "vllm:spec_decode_num_draft_tokens_total",
            "vllm:spec_decode_num_draft_tokens",
        ):
            load.spec_draft_tokens += value
        elif name in (
            "vllm:spec_decode_num_accepted_tokens_total",
            "vllm:spec_decode_num_accepted_tokens",
        ):
            load.spec_accepted_tokens += value
        elif name == "vllm:cache_config_info":
            if labels.get("num_gpu_blocks", "").isdigit():
                load.total_blocks += int(labels["num_gpu_blocks"])
            if labels.get("num_cpu_blocks", "").isdigit():
                load.host_blocks = max(load.host_blocks, int(labels["num_cpu_blocks"]))
            if labels.get("block_size", "").isdigit():
                load.block_size = int(labels["block_size"])
        elif name == "vllm:lora_requests_info":
            _lora_info(load, labels, value)
        elif name == "process_start_time_seconds":
            load.process_start_time = value
        elif name in (COST_METRIC, TIER_BLOCKS_METRIC):
            _tier_sample(load, name, labels, value)
    if usage:
        load.kv_usage = min(max(sum(usage) / len(usage), 0.0), 1.0)
    return load


def _lora_info(load: EngineLoad, labels: dict[str, str], value: float) -> None:
    """vLLM publishes one sample per change, its value the time of the change: keep the newest."""
    if value < load.lora_info_time:
        return
    load.lora_info_time = value
    if labels.get("max_lora", "").isdigit():
        load.max_loras = int(labels["max_lora"])

    def names(key: str) -> tuple[str, ...]:
        return tuple(n for n in labels.get(key, "").split(",") if n)

    load.active_adapters = names("running_lora_adapters")
    load.waiting_adapters = names("waiting_lora_adapters")


def _tier_sample(load: EngineLoad, name: str, labels: dict[str, str], value: float) -> None:
    """A KV-tier gauge: a cost per block (by source), or the blocks a tier holds (by medium)."""
    if name == COST_METRIC:
        fld = COST_SOURCES.get(labels.get("source", ""))
        if fld is not None and value > 0:
            load.tier_costs[fld] = value
    elif labels.get("medium") == MEDIUM_CPU:
        # a host tier: its size when cache_config_info does not say it (at least one block)
        load.host_blocks = max(load.host_blocks, int(value), 1)
    elif labels.get("medium") == MEDIUM_SHARED:
        load.shared_tier = True
