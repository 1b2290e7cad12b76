"""The engine's readiness and load over HTTP, read the way each engine kind serves them.

Our engine answers ``/ready`` (200 ready, 503 loading or draining) and ``/metrics``. vLLM has no
``/ready``: it is ready when ``/health`` answers 200 and ``/v1/models`` lists the served model;
its ``/metrics`` has the same ``vllm:`` names ``engine_load`` reads. Whatever keeps an engine
from being read as ready is said in ``EngineReading.problem`` (the sidecar's probes show it and
the heartbeat logs it once), so a wrong flag never looks like an idle deployment.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from kvmesh.common.engine_load import EngineLoad, engine_load
from kvmesh.sidecar.adapters import AdapterList


@dataclass
class EngineReading:
    ready: bool
    load: EngineLoad | None
    problem: str | None = (
        None  # why the engine is not read as ready (None: it is, or it is loading)
    )
    adapters: dict[str, str] | None = None  # name -> digest (None: it serves no adapters)


def read_engine(
    client: httpx.Client,
    url: str,
    engine_format: str,
    model: str,
    block_size: int,
    adapters: AdapterList | None = None,
) -> EngineReading:
    """One reading of the engine at `url`; raises httpx.HTTPError when it cannot be reached."""
    adapters = adapters or AdapterList(model)
    if engine_format == "vllm":
        return _read_vllm(client, url, model, block_size, adapters)
    return _read_kvmesh(client, url, adapters)


def _read_kvmesh(client: httpx.Client, url: str, adapters: AdapterList) -> EngineReading:
    ready = client.get(url + "/ready")
    load, problem = _load(client, url)
    if ready.status_code not in (200, 503):
        hint = " (a vLLM server needs --engine-format vllm)" if ready.status_code == 404 else ""
        problem = f"GET {url}/ready answered {ready.status_code}{hint}"
    served = None
    if ready.status_code == 200 and load is not None and load.max_loras:
        models = client.get(url + "/v1/models")
        if models.status_code == 200:
            served = adapters.read(_entries(models))
        else:  # its adapters stay unknown: no replica is routed adapter traffic for them
            key = " (the sidecar needs KVMESH_ENGINE_API_KEY)" if models.status_code == 401 else ""
            problem = f"GET {url}/v1/models answered {models.status_code}{key}"
    return EngineReading(ready.status_code == 200, load, problem, served)


def _read_vllm(
    client: httpx.Client, url: str, model: str, block_size: int, adapters: AdapterList
) -> EngineReading:
    health = client.get(url + "/health")
    if health.status_code != 200:
        return EngineReading(False, None, f"vLLM GET {url}/health answered {health.status_code}")
    models = client.get(url + "/v1/models")
    load, problem = _load(client, url)
    if models.status_code != 200:
        hint = " (its API key: KVMESH_ENGINE_API_KEY)" if models.status_code == 401 else ""
        return EngineReading(
            False, load, f"vLLM GET {url}/v1/models answered {models.status_code}{hint}"
        )
    entries = _entries(models)
    served = [m.get("id") for m in entries if isinstance(m, dict)]
    if model not in served:
        return EngineReading(
            False, load, f"vLLM serves {served[:8]}, not {model!r} (--served-model-name / --model)"
        )
    if load is not None and load.block_size not in (None, block_size):
        problem = (
            f"vLLM's block size is {load.block_size}, --block-size {block_size}: "
            "the block keys will not match the router's"
        )
    lora = adapters.read(entries) if load is not None and load.max_loras else None
    return EngineReading(True, load, problem, lora)


def _load(client: httpx.Client, url: str) -> tuple[EngineLoad | None, str | None]:
    metrics = client.get(url + "/metrics")
    if metrics.status_code != 200:
        return None, f"GET {url}/metrics answered {metrics.status_code}"
    return engine_load(metrics.text), None


def _entries(resp: httpx.Response) -> list:
    """The ``data`` list of a /v1/models answer ([] when it is not one)."""
    try:
        data = resp.json().get("data")
    except (ValueError, AttributeError):
        return []
    return data if isinstance(data, list) else []
