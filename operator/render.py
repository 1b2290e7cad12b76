"""Spec -> children, as plain data. A pure function: no I/O, no clock, no randomness.

:func:`render_children` returns every object the operator owns for one
ModelDeployment, each with an owner reference to it (so deleting the resource
deletes everything). The pods call exactly the flags of docs/cli.md.
"""

from __future__ import annotations

import base64
import hashlib
import json
import posixpath
import shlex
from dataclasses import dataclass
from typing import Any

from kvmesh.common.chat_prompt import tool_call_parser_in
from kvmesh.common.model_lookup import converted_dir
from kvmesh.common.vllm_args import VLLM_IMAGE, size_bytes, vllm_serve_args
from kvmesh.operator import adapters as lora
from kvmesh.operator import crd, kv_offload
from kvmesh.operator.spec import GPU, served_model_name

VERSION = "0.1.0"
FIELD_MANAGER = "kvmesh-operator"
LABEL_MD = "kvmesh.io/model-deployment"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_SCRAPER = "kvmesh.io/metrics-scraper"
ENGINE, ROUTER, REDIS = "engine", "router", "redis"
MODELS_DIR = "/models"
ROUTER_PRESTOP_SLEEP_SECONDS = 5  # let the Service endpoints drop a router before it stops
KV_EVENTS_PORT, KV_REPLAY_PORT = 5557, 5558
SIDECAR_HEALTH_PORT = 8081
METRICS_PORT = 8001  # /metrics alone (engine and router): the only engine port scrapers reach
RUN_AS_USER = 10001
OPERATOR_POD_LABELS = {
    "app.kubernetes.io/name": "kvmesh",
    "app.kubernetes.io/component": "operator",
}


@dataclass(frozen=True)
class Images:
    """Default images (overridable per ModelDeployment and by `kvmesh operator` flags)."""

    engine: str = f"ghcr.io/kvmesh/engine:{VERSION}"
    vllm: str = VLLM_IMAGE  # engine.kind vllm
    router: str = f"ghcr.io/kvmesh/router:{VERSION}"  # also runs `kvmesh sidecar`
    redis: str = "redis:7.4-alpine"


MODEL_CACHE = "model-cache"
MODEL_READY_MARKER = ".kvmesh-model-ready"  # written by the fetch Job when the download is complete


def names(md_name: str) -> dict[str, str]:
    """Child object names."""
    return {
        ENGINE: f"{md_name}-engine",
        ROUTER: f"{md_name}-router",
        REDIS: f"{md_name}-redis",
        "redis-secret": f"{md_name}-redis-url",
        "netpol": f"{md_name}-engine",
        MODEL_CACHE: f"{md_name}-model-cache",
        "engine-api-key": f"{md_name}-engine-api-key",
        "redis-auth": f"{md_name}-redis-auth",
        "redis-netpol": f"{md_name}-redis",
        "adapters": f"{md_name}-adapters",
    }


def labels(md_name: str, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "kvmesh",
        "app.kubernetes.io/instance": md_name,
        LABEL_COMPONENT: component,
        "app.kubernetes.io/managed-by": FIELD_MANAGER,
        LABEL_MD: md_name,
    }


def selector(md_name: str, component: str) -> dict[str, str]:
    return {LABEL_MD: md_name, LABEL_COMPONENT: component}


def selector_string(md_name: str, component: str = ENGINE) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(selector(md_name, component).items()))


def router_endpoint(md_name: str, namespace: str) -> str:
    return f"http://{names(md_name)[ROUTER]}.{namespace}.svc:{crd.ROUTER_PORT}"


def managed_redis_url(md_name: str, namespace: str) -> str:
    return f"redis://{names(md_name)[REDIS]}.{namespace}.svc:{crd.REDIS_PORT}/0"


def redis_secret_ref(md_name: str, spec: dict[str, Any]) -> tuple[str, str]:
    """(Secret name, key) holding the Redis URL the pods use."""
    redis = spec.get("redis") or {}
    if redis.get("mode") == "external" and "secretRef" in redis and "url" not in redis:
        return redis["secretRef"]["name"], redis["secretRef"].get("key", "url")
    if redis.get("mode", "managed") == "managed" and redis.get("requirePassword", True):
        return names(md_name)["redis-auth"], "url"
    return names(md_name)["redis-secret"], "url"


# --- Generated credentials: made once by the operator (random), never rendered. ---


def generated_secret_names(md_name: str, spec: dict[str, Any]) -> list[str]:
    """The Secrets the operator generates for this spec (created once, kept, owned)."""
    out = []
    if spec["engine"].get("requireApiKey", True):
        out.append(names(md_name)["engine-api-key"])
    if spec["redis"]["mode"] == "managed" and spec["redis"].get("requirePassword", True):
        out.append(names(md_name)["redis-auth"])
    return out


def generated_secret(
    md: dict[str, Any], spec: dict[str, Any], name: str, token: str
) -> dict[str, Any]:
    """One generated Secret around a random ``token`` (the caller draws it)."""
    md_name, ns = md["metadata"]["name"], md["metadata"]["namespace"]
    if name == names(md_name)["engine-api-key"]:
        data, component = {"api-key": token}, ENGINE
    elif name == names(md_name)["redis-auth"]:
        url = managed_redis_url(md_name, ns).replace("redis://", f"redis://:{token}@", 1)
        data, component = {"password": token, "url": url}, REDIS
    else:
        raise KeyError(name)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(md, name, component),
        "type": "Opaque",
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
    }


def _annotations(annotations: dict[str, str]) -> dict[str, Any]:
    return {"annotations": annotations} if annotations else {}


def _secret_env(env: str, secret: str, key: str) -> dict[str, Any]:
    return {"name": env, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def _credentials_annotation(credentials: str | None) -> dict[str, str]:
    """Pods roll when a generated credential is replaced (e.g. its Secret was deleted and
    made anew), so engines and routers never hold different keys."""
    return {"kvmesh.io/credentials": credentials} if credentials else {}


def engine_replicas(spec: dict[str, Any], status: dict[str, Any] | None = None) -> int:
    """Replicas of the engine Deployment: spec.replicas (written by the user, the builtin
    autoscaler or an HPA through /scale), kept within [min, max] when autoscaling."""
    replicas = int(spec.get("replicas", 1))
    if "autoscaling" not in spec:
        return replicas
    auto = spec["autoscaling"]
    lo, hi = int(auto.get("minReplicas", 1)), int(auto["maxReplicas"])
    return max(lo, min(hi, replicas))


def _meta(md: dict[str, Any], name: str, component: str) -> dict[str, Any]:
    m = md["metadata"]
    return {
        "name": name,
        "namespace": m["namespace"],
        "labels": labels(m["name"], component),
        "ownerReferences": [
            {
                "apiVersion": crd.API_VERSION,
                "kind": crd.KIND,
                "name": m["name"],
                "uid": m["uid"],
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }


def _image_pull_secrets(spec: dict[str, Any]) -> dict[str, Any]:
    secrets = (spec.get("engine") or {}).get("imagePullSecrets") or []
    return {"imagePullSecrets": [{"name": s["name"]} for s in secrets]} if secrets else {}


def _probe(kind: str, path: str, timing: dict[str, Any]) -> dict[str, Any]:
    del kind
    return {
        "httpGet": {"path": path, "port": "http"},
        **{k: int(v) for k, v in sorted(timing.items())},
    }


def _container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _pod_security(user: int = RUN_AS_USER) -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": user,
        "runAsGroup": user,
        "fsGroup": user,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _resources(res: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("requests", "limits"):
        if (res or {}).get(kind):
            out[kind] = {k: v for k, v in sorted(res[kind].items())}
    # Extended resources (GPUs) must be in limits; requests default to limits.
    if GPU in out.get("requests", {}) and GPU not in out.get("limits", {}):
        out.setdefault("limits", {})[GPU] = out["requests"][GPU]
    return out


def _model_arg(spec: dict[str, Any]) -> str:
    model = spec["model"]
    if "builtin" in model:
        return model["builtin"]
    if "huggingFace" in model:
        return model_dir(spec)
    path = (model["pvc"].get("path") or "").strip("/")
    return posixpath.join(MODELS_DIR, path) if path else MODELS_DIR


def engine_args(spec: dict[str, Any]) -> list[str]:
    """The `kvmesh serve` command line of the engine container."""
    eng = spec["engine"]
    args = [
        "kvmesh",
        "serve",
        "--model",
        _model_arg(spec),
        "--served-model-name",
        served_model_name(spec),
        "--host",
        "0.0.0.0",
        "--port",
        str(crd.ENGINE_PORT),
        "--block-size",
        str(eng["blockSize"]),
        *(
            ["--max-num-batched-tokens", str(eng["maxNumBatchedTokens"])]
            if "maxNumBatchedTokens" in eng
            else []
        ),
        "--max-num-seqs",
        str(eng["maxNumSeqs"]),
        "--enable-prefix-caching" if eng["enablePrefixCaching"] else "--no-enable-prefix-caching",
        "--enable-chunked-prefill"
        if eng["enableChunkedPrefill"]
        else "--no-enable-chunked-prefill",
        "--dtype",
        eng["dtype"],
        "--kv-events-endpoint",
        f"tcp://127.0.0.1:{KV_EVENTS_PORT}",  # in-pod only
        "--kv-events-replay-endpoint",
        f"tcp://127.0.0.1:{KV_REPLAY_PORT}",
        "--drain-timeout",
        str(eng["drainTimeoutSeconds"]),
        "--metrics-port",
        str(METRICS_PORT),
    ]
    if eng.get("maxModelLen"):
        args += ["--max-model-len", str(eng["maxModelLen"])]
    if eng.get("kvCacheMemory"):
        args += ["--kv-cache-memory", eng["kvCacheMemory"]]
    if eng.get("toolCallParser"):
        args += ["--enable-auto-tool-choice", "--tool-call-parser", eng["toolCallParser"]]
    return (
        args
        + kv_offload.engine_flags(spec)
        + lora.lora_flags(spec)
        + list(eng.get("extraArgs") or [])
    )


def is_vllm(spec: dict[str, Any]) -> bool:
    return spec["engine"].get("kind", "kvmesh") == "vllm"


def vllm_engine_args(spec: dict[str, Any]) -> list[str]:
    """The `vllm serve` command line of a vLLM engine container, from the same spec fields."""
    eng = spec["engine"]
    extra = ["--shutdown-timeout", str(eng["drainTimeoutSeconds"])]
    if eng.get("kvCacheMemory"):
        extra += ["--kv-cache-memory-bytes", str(size_bytes(eng["kvCacheMemory"]))]
    if "maxNumBatchedTokens" in eng:
        extra += ["--max-num-batched-tokens", str(eng["maxNumBatchedTokens"])]
    if not eng["enableChunkedPrefill"]:
        extra += ["--no-enable-chunked-prefill"]
    return vllm_serve_args(
        _vllm_model_arg(spec),
        served_model_name(spec),
        crd.ENGINE_PORT,
        KV_EVENTS_PORT,
        KV_REPLAY_PORT,
        block_size=eng["blockSize"],
        prefix_caching=eng["enablePrefixCaching"],
        dtype=eng["dtype"],
        max_model_len=eng.get("maxModelLen"),
        max_num_seqs=eng["maxNumSeqs"],
        gpu_memory_utilization=eng.get("gpuMemoryUtilization"),
        tool_call_parser=eng.get("toolCallParser"),
        extra=extra
        + kv_offload.engine_flags(spec, vllm=True)
        + lora.lora_flags(spec)
        + list(eng.get("extraArgs") or []),
    )


def _vllm_model_arg(spec: dict[str, Any]) -> str:
    """vLLM reads a Hugging Face directory: a built-in model is its converted one in kvmesh's
    cache as the operator sees it (the local cluster; in a real cluster use huggingFace or pvc)."""
    model = spec["model"]
    if "builtin" in model:
        return str(converted_dir(model["builtin"]))
    return _model_arg(spec)


def engine_command(spec: dict[str, Any]) -> list[str]:
    """The engine's argv; with LoRA, wrapped to add the adapter list it reads at start."""
    argv = vllm_engine_args(spec) if is_vllm(spec) else engine_args(spec)
    return lora.wrapped(argv) if lora.enabled(spec) else argv


def engine_image(spec: dict[str, Any], images: Images) -> str:
    return spec["engine"].get("image") or (images.vllm if is_vllm(spec) else images.engine)


def fetch_image(spec: dict[str, Any], images: Images) -> str:
    """The image of the model fetch and wait containers: kvmesh's engine image (python and
    huggingface_hub), also beside a vLLM engine."""
    return images.engine if is_vllm(spec) else engine_image(spec, images)


def sidecar_args(spec: dict[str, Any]) -> list[str]:
    """The `kvmesh sidecar` command line (Redis URL, pod name and URL come from env)."""
    return [
        "kvmesh",
        "sidecar",
        "--engine-url",
        f"http://127.0.0.1:{crd.ENGINE_PORT}",
        "--kv-events-endpoint",
        f"tcp://127.0.0.1:{KV_EVENTS_PORT}",
        "--kv-events-replay-endpoint",
        f"tcp://127.0.0.1:{KV_REPLAY_PORT}",
        "--model",
        served_model_name(spec),
        "--block-size",
        str(spec["engine"]["blockSize"]),
        "--heartbeat-interval",
        _num(spec["engine"]["heartbeatIntervalSeconds"]),
        "--health-port",
        str(SIDECAR_HEALTH_PORT),
        *(["--engine-format", "vllm"] if is_vllm(spec) else []),
    ]


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def router_args(spec: dict[str, Any], md_name: str) -> list[str]:
    """The `kvmesh router` command line (Redis URL from env). Where the engines are comes
    from the platform (the engine Service's EndpointSlices), never from Redis."""
    router = spec["router"]
    w = router["weights"]
    args = [
        "kvmesh",
        "router",
        "--model",
        served_model_name(spec),
        "--host",
        "0.0.0.0",
        "--k8s-service",
        names(md_name)[ENGINE],
        "--metrics-port",
        str(METRICS_PORT),
        "--port",
        str(crd.ROUTER_PORT),
        "--policy",
        router["policy"],
        "--weights",
        f"prefix={_num(w['prefix'])},kv={_num(w['kv'])},queue={_num(w['queue'])}",
        "--block-size",
        str(spec["engine"]["blockSize"]),
        "--max-resumes",
        str(router["maxResumes"]),
        "--resume-timeout",
        _num(router["resumeTimeoutSeconds"]),
    ]
    model = spec["model"]
    if "huggingFace" in model:
        args += ["--tokenizer", model["huggingFace"]["repoId"]]
    elif "pvc" in model:
        args += ["--tokenizer", _model_arg(spec)]
    if router.get("apiKeySecretRef"):
        args += ["--api-keys-file", "/etc/kvmesh/api-keys/keys"]
    if is_vllm(spec):
        args += ["--engine", "vllm"]
    parser = spec["engine"].get("toolCallParser") or tool_call_parser_in(
        list(spec["engine"].get("extraArgs") or [])
    )
    if parser:  # tool requests rendered as the engines render them
        args += ["--tool-call-parser", parser]
    return args + flow_args(router.get("flowControl") or {})


def flow_args(flow: dict[str, Any]) -> list[str]:
    """`spec.router.flowControl` as the router's --flow-* flags (none while it is off)."""
    if not flow.get("enabled"):
        return []
    args = ["--flow-control"]
    for b in flow.get("bands") or ():
        band = f"{b['name']}:{b['priority']}:{_num(b.get('weight', 1))}:{b.get('maxQueued', 256)}"
        args += ["--flow-band", band]
    for key, flag in (
        ("defaultBand", "--flow-default-band"),
        ("maxQueued", "--flow-max-queued"),
        ("deadlineSeconds", "--flow-deadline"),
        ("kvThreshold", "--flow-kv-threshold"),
        ("queueThreshold", "--flow-queue-threshold"),
        ("podMaxInflight", "--flow-pod-max-inflight"),
        ("maxTenants", "--flow-max-tenants"),
    ):
        if key in flow:
            value = flow[key]
            args += [flag, value if isinstance(value, str) else _num(value)]
    return args


def _redis_env(md_name: str, spec: dict[str, Any]) -> dict[str, Any]:
    secret, key = redis_secret_ref(md_name, spec)
    return {"name": "KVMESH_REDIS_URL", "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def _model_volumes(spec: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    """(volumes, engine volumeMounts) for the model source."""
    model = spec["model"]
    if uses_shared_cache(spec):
        return (
            [
                {
                    "name": "models",
                    "persistentVolumeClaim": {
                        "claimName": model_cache_claim(spec, "?"),
                        "readOnly": True,
                    },
                }
            ],
            [{"name": "models", "mountPath": MODELS_DIR, "readOnly": True}],
        )
    if "huggingFace" in model:
        return (
            [{"name": "models", "emptyDir": {"sizeLimit": model["huggingFace"]["cacheSize"]}}],
            [{"name": "models", "mountPath": MODELS_DIR, "readOnly": True}],
        )
    if "pvc" in model:
        return (
            [
                {
                    "name": "models",
                    "persistentVolumeClaim": {
                        "claimName": model["pvc"]["claimName"],
                        "readOnly": True,
                    },
                }
            ],
            [{"name": "models", "mountPath": MODELS_DIR, "readOnly": True}],
        )
    return [], []


def uses_shared_cache(spec: dict[str, Any]) -> bool:
    hf = (spec.get("model") or {}).get("huggingFace") or {}
    return bool((hf.get("sharedCache") or {}).get("enabled"))


def model_cache_claim(spec: dict[str, Any], md_name: str) -> str:
    """The shared model cache's claim (one per ModelDeployment)."""
    del spec
    return names(md_name)[MODEL_CACHE]


def _revision_digest(spec: dict[str, Any]) -> str:
    hf = spec["model"]["huggingFace"]
    return hashlib.sha256(f"{hf['repoId']}@{hf['revision']}".encode()).hexdigest()[:10]


def model_dir(spec: dict[str, Any]) -> str:
    """Where the engine finds a Hugging Face model: one directory per (repo, revision) on
    the shared cache, so a new revision never overwrites the one old pods still read."""
    if uses_shared_cache(spec):
        return posixpath.join(MODELS_DIR, _revision_digest(spec))
    return posixpath.join(MODELS_DIR, "model")


def _download_script(spec: dict[str, Any], marker: bool) -> str:
    hf = spec["model"]["huggingFace"]
    script = (
        "from huggingface_hub import snapshot_download; "
        f"snapshot_download(repo_id={hf['repoId']!r}, revision={hf['revision']!r}, "
        f"local_dir={model_dir(spec)!r})"
    )
    if marker:  # written last, so a reader never sees a half-downloaded model as ready
        stamp = json.dumps(f"{hf['repoId']}@{hf['revision']}")
        script += (
            f"; open({posixpath.join(model_dir(spec), MODEL_READY_MARKER)!r}, 'w').write({stamp})"
        )
    return script


def _download_init_container(spec: dict[str, Any], image: str, pull: str) -> dict[str, Any]:
    hf = spec["model"]["huggingFace"]
    script = _download_script(spec, marker=False)
    env: list[dict[str, Any]] = [
        {"name": "HF_HOME", "value": "/tmp/hf"},
        {"name": "HOME", "value": "/tmp"},
    ]
    if hf.get("tokenSecretRef"):
        ref = hf["tokenSecretRef"]
        env.append(
            {
                "name": "HF_TOKEN",
                "valueFrom": {
                    "secretKeyRef": {"name": ref["name"], "key": ref.get("key", "HF_TOKEN")}
                },
            }
        )
    return {
        "name": "fetch-model",
        "image": image,
        "imagePullPolicy": pull,
        "command": ["python", "-c", script],
        "env": env,
        "volumeMounts": [
            {"name": "models", "mountPath": MODELS_DIR},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "securityContext": _container_security(),
    }


def render_engine_deployment(
    md: dict[str, Any], spec: dict[str, Any], images: Images, credentials: str | None = None
) -> dict[str, Any]:
    """The engine pods' Deployment (engine + sidecar). Kept whole: it reads as the manifest
    `kubectl get -o yaml` shows, each field next to the spec value it comes from."""
    name = md["metadata"]["name"]
    eng = spec["engine"]
    image = engine_image(spec, images)
    tools_image = fetch_image(spec, images)
    vllm = is_vllm(spec)
    sidecar_image = spec["router"].get("image") or images.router
    pull = eng["imagePullPolicy"]
    model_vols, model_mounts = _model_volumes(spec)
    if uses_shared_cache(spec):
        model_vols[0]["persistentVolumeClaim"]["claimName"] = model_cache_claim(spec, name)
    common_mounts = [{"name": "tmp", "mountPath": "/tmp"}]
    grace = int(eng["terminationGracePeriodSeconds"])
    probes = eng["probes"]
    engine = {
        "name": "engine",
        "image": image,
        "imagePullPolicy": pull,
        "command": engine_command(spec),
        # vLLM serves /metrics on its API port: no metrics port of its own.
        "ports": [{"name": "http", "containerPort": crd.ENGINE_PORT, "protocol": "TCP"}]
        + ([] if vllm else [_METRICS_CONTAINER_PORT]),
        "env": [{"name": "HOME", "value": "/tmp"}, {"name": "HF_HOME", "value": "/tmp/hf"}]
        + ([lora.RUNTIME_UPDATING_ENV] if lora.enabled(spec) else [])
        + (
            [_secret_env(_ENGINE_KEY_ENV[vllm], names(name)["engine-api-key"], "api-key")]
            if eng["requireApiKey"]
            else []
        )
        + list(eng.get("env") or []),
        "resources": kv_offload.grown_resources(_resources(eng.get("resources")), spec),
        "startupProbe": _probe("startup", "/health", probes["startup"]),
        # vLLM has no /ready: /health answers once the model is loaded.
        "readinessProbe": _probe("readiness", "/health" if vllm else "/ready", probes["readiness"]),
        "livenessProbe": _probe("liveness", "/health", probes["liveness"]),
        "lifecycle": {"preStop": {"sleep": {"seconds": int(eng["preStopSleepSeconds"])}}},
        "volumeMounts": common_mounts
        + [{"name": "dshm", "mountPath": "/dev/shm"}]
        + model_mounts
        + _adapter_mounts(spec)
        + kv_offload.mounts(spec)
        + list(eng.get("volumeMounts") or []),
        "securityContext": _container_security(),
    }
    if eng.get("envFrom"):
        engine["envFrom"] = list(eng["envFrom"])
    sidecar = {
        "name": "sidecar",
        "image": sidecar_image,
        "imagePullPolicy": pull,
        "command": sidecar_args(spec),
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "KVMESH_POD_URL", "value": f"http://$(POD_IP):{crd.ENGINE_PORT}"},
            _redis_env(name, spec),
            {"name": "HOME", "value": "/tmp"},
        ]
        + (
            # The sidecar reads /v1/models (vLLM's readiness, and the adapters an engine serves
            # with LoRA on), which wants the key the engine's API is served with.
            [_secret_env("KVMESH_ENGINE_API_KEY", names(name)["engine-api-key"], "api-key")]
            if eng["requireApiKey"] and (vllm or lora.enabled(spec))
            else []
        ),
        "ports": [
            {"name": "sidecar-health", "containerPort": SIDECAR_HEALTH_PORT, "protocol": "TCP"}
        ],
        # A dead KV-event loop restarts the sidecar (a stale index is already withdrawn from
        # Redis, so the engine keeps serving by load: no readiness probe takes it out).
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "sidecar-health"},
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp", "subPath": "sidecar"}],
        "securityContext": _container_security(),
    }
    pod_spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": grace,
        "securityContext": _pod_security(),
        "automountServiceAccountToken": False,
        **_image_pull_secrets(spec),
        "containers": [engine, sidecar],
        "volumes": [
            {"name": "tmp", "emptyDir": {}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": eng["shmSize"]}},
        ]
        + model_vols
        + _adapter_volumes(md, spec)
        + kv_offload.volumes(spec)
        + list(eng.get("volumes") or []),
    }
    if uses_shared_cache(spec):
        pod_spec["initContainers"] = [_wait_for_model_container(spec, tools_image, pull)]
    elif "huggingFace" in spec["model"]:
        pod_spec["initContainers"] = [_download_init_container(spec, tools_image, pull)]
    for key in ("nodeSelector", "affinity"):
        if eng.get(key):
            pod_spec[key] = dict(eng[key])
    for key in ("priorityClassName", "runtimeClassName"):
        if eng.get(key):
            pod_spec[key] = eng[key]
    if eng.get("topologySpreadConstraints"):
        pod_spec["topologySpreadConstraints"] = list(eng["topologySpreadConstraints"])
    if eng.get("tolerations"):
        pod_spec["tolerations"] = list(eng["tolerations"])
    if GPU in (_resources(eng.get("resources")).get("limits") or {}):
        pod_spec.setdefault("tolerations", []).append(
            {"key": GPU, "operator": "Exists", "effect": "NoSchedule"}
        )
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(md, names(name)[ENGINE], ENGINE),
        "spec": {
            "replicas": engine_replicas(spec, md.get("status")),
            "selector": {"matchLabels": selector(name, ENGINE)},
            "strategy": _strategy(eng["rollout"]),
            "template": {
                "metadata": {
                    "labels": labels(name, ENGINE),
                    "annotations": {
                        "kvmesh.io/model": served_model_name(spec),
                        **_credentials_annotation(credentials),
                    },
                },
                "spec": pod_spec,
            },
        },
    }


def _adapter_mounts(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The adapter list (a ConfigMap) and the claims of PVC adapters, read-only."""
    if not lora.enabled(spec):
        return []
    return [{"name": "adapters", "mountPath": lora.CONFIG_DIR, "readOnly": True}] + [
        {"name": lora.claim_volume_name(c), "mountPath": lora.claim_dir(c), "readOnly": True}
        for c in lora.adapter_claims(spec)
    ]


def _adapter_volumes(md: dict[str, Any], spec: dict[str, Any]) -> list[dict[str, Any]]:
    if not lora.enabled(spec):
        return []
    config = {"name": names(md["metadata"]["name"])["adapters"], "optional": True}
    return [{"name": "adapters", "configMap": config}] + [
        {
            "name": lora.claim_volume_name(c),
            "persistentVolumeClaim": {"claimName": c, "readOnly": True},
        }
        for c in lora.adapter_claims(spec)
    ]


def render_adapters_config(md: dict[str, Any], spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The adapter list engines read at start (kept out of the pod template: no rollout)."""
    if not lora.enabled(spec):
        return []
    return [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _meta(md, names(md["metadata"]["name"])["adapters"], ENGINE),
            "data": lora.config_data(spec),
        }
    ]


LABEL_ADAPTER_DIR = "kvmesh.io/adapter-dir"  # on an adapter fetch Job: the directory it fills


def _adapter_fetch_container(spec: dict[str, Any], images: Images, adapter: lora.Adapter):
    hf = adapter.source["huggingFace"]
    revision = hf.get("revision", "main")
    fetch = _download_init_container(
        {"model": {"huggingFace": {**hf, "revision": revision}}},
        fetch_image(spec, images),
        spec["engine"]["imagePullPolicy"],
    )
    marker = posixpath.join(adapter.path, lora.READY_MARKER)
    fetch["name"] = "fetch-adapter"
    fetch["command"] = [
        "python",
        "-c",
        "from huggingface_hub import snapshot_download; "
        f"snapshot_download(repo_id={hf['repoId']!r}, revision={revision!r}, "
        f"local_dir={adapter.path!r}); open({marker!r}, 'w').write('ready')",
    ]
    fetch["resources"] = {
        "requests": {"cpu": "100m", "memory": "256Mi"},
        "limits": {"memory": "1Gi"},
    }
    return fetch


def render_adapter_fetches(
    md: dict[str, Any], spec: dict[str, Any], images: Images
) -> list[dict[str, Any]]:
    """A download Job per Hugging Face adapter, into the model's shared cache claim. As the
    model's, a Job's template is immutable: a new template is a new Job (the digest)."""
    name = md["metadata"]["name"]
    jobs = []
    for adapter in lora.adapters(spec):
        if not adapter.from_hugging_face or not uses_shared_cache(spec):
            continue
        claim = {"claimName": model_cache_claim(spec, name)}
        template = {
            "metadata": {"labels": labels(name, MODEL_CACHE)},
            "spec": {
                "restartPolicy": "OnFailure",
                "securityContext": _pod_security(),
                "automountServiceAccountToken": False,
                **_image_pull_secrets(spec),
                "containers": [_adapter_fetch_container(spec, images, adapter)],
                "volumes": [
                    {"name": "models", "persistentVolumeClaim": claim},
                    {"name": "tmp", "emptyDir": {}},
                ],
            },
        }
        digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:8]
        meta = _meta(md, f"{name}-adapter-{digest}", MODEL_CACHE)
        meta["labels"][LABEL_ADAPTER_DIR] = posixpath.basename(adapter.path)
        jobs.append(
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": meta,
                "spec": {"backoffLimit": 6, "template": template},
            }
        )
    return jobs


def _strategy(rollout: dict[str, Any]) -> dict[str, Any]:
    """RollingUpdate (default: surge one pod, never take serving capacity away) or Recreate."""
    if rollout["strategy"] == "Recreate":
        return {"type": "Recreate"}
    return {
        "type": "RollingUpdate",
        "rollingUpdate": {
            "maxSurge": rollout["maxSurge"],
            "maxUnavailable": rollout["maxUnavailable"],
        },
    }


def _wait_for_model_container(spec: dict[str, Any], image: str, pull: str) -> dict[str, Any]:
    """Engines on the shared cache wait until the fetch Job has written its marker."""
    marker = posixpath.join(model_dir(spec), MODEL_READY_MARKER)
    script = (
        "import os, sys, time\n"
        f"print('waiting for the model-fetch Job to fill the shared cache ({marker})', flush=True)\n"
        f"while not os.path.exists({marker!r}):\n    time.sleep(2)\n"
    )
    return {
        "name": "wait-for-model",
        "image": image,
        "imagePullPolicy": pull,
        "command": ["python", "-c", script],
        "volumeMounts": [{"name": "models", "mountPath": MODELS_DIR, "readOnly": True}],
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "64Mi"}},
        "securityContext": _container_security(),
    }


def render_model_cache(
    md: dict[str, Any], spec: dict[str, Any], images: Images
) -> list[dict[str, Any]]:
    """The shared model cache: a claim, and a Job that downloads the model into it once."""
    if not uses_shared_cache(spec):
        return []
    name = md["metadata"]["name"]
    hf = spec["model"]["huggingFace"]
    cache = hf["sharedCache"]
    image = fetch_image(spec, images)
    pull = spec["engine"]["imagePullPolicy"]
    claim: dict[str, Any] = {
        "accessModes": [cache["accessMode"]],
        "resources": {"requests": {"storage": hf["cacheSize"]}},
    }
    if cache.get("storageClassName"):
        claim["storageClassName"] = cache["storageClassName"]
    fetch = _download_init_container(spec, image, pull)
    fetch["command"] = ["python", "-c", _download_script(spec, marker=True)]
    fetch["resources"] = {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "4Gi"}}
    template = {
        "metadata": {"labels": labels(name, MODEL_CACHE)},
        "spec": {
            "restartPolicy": "OnFailure",
            "securityContext": _pod_security(),
            "automountServiceAccountToken": False,
            **_image_pull_secrets(spec),
            "containers": [fetch],
            "volumes": [
                {
                    "name": "models",
                    "persistentVolumeClaim": {"claimName": model_cache_claim(spec, name)},
                },
                {"name": "tmp", "emptyDir": {}},
            ],
        },
    }
    # A Job's template is immutable: a new template (revision, image) is a new Job, and the
    # old one is pruned. The same template is the same Job, which never runs twice.
    digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:8]
    return [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": _meta(md, model_cache_claim(spec, name), MODEL_CACHE),
            "spec": claim,
        },
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": _meta(md, f"{name}-fetch-{digest}", MODEL_CACHE),
            "spec": {"backoffLimit": 6, "template": template},
        },
    ]


def render_pdbs(md: dict[str, Any], spec: dict[str, Any]) -> list[dict[str, Any]]:
    """PodDisruptionBudgets: node drains evict engines (and routers) a few at a time."""
    name = md["metadata"]["name"]
    out = []
    for component, budget, present in (
        (ENGINE, spec["engine"]["podDisruptionBudget"], True),
        (ROUTER, spec["router"]["podDisruptionBudget"], int(spec["router"]["replicas"]) >= 2),
    ):
        if budget["enabled"] and present:
            out.append(
                {
                    "apiVersion": "policy/v1",
                    "kind": "PodDisruptionBudget",
                    "metadata": _meta(md, names(name)[component], component),
                    "spec": {
                        "maxUnavailable": budget["maxUnavailable"],
                        "selector": {"matchLabels": selector(name, component)},
                    },
                }
            )
    return out


# The engine's API key variable: our engine's, or vLLM's.
_ENGINE_KEY_ENV = {False: "KVMESH_API_KEY", True: "VLLM_API_KEY"}
_METRICS_CONTAINER_PORT = {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}
_METRICS_SERVICE_PORT = {
    "name": "metrics",
    "port": METRICS_PORT,
    "targetPort": "metrics",
    "protocol": "TCP",
}


def render_engine_service(md: dict[str, Any]) -> dict[str, Any]:
    name = md["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(md, names(name)[ENGINE], ENGINE),
        "spec": {
            "clusterIP": "None",
            "selector": selector(name, ENGINE),
            "publishNotReadyAddresses": False,
            "ports": [
                {"name": "http", "port": crd.ENGINE_PORT, "targetPort": "http", "protocol": "TCP"},
                _METRICS_SERVICE_PORT,
            ],
        },
    }


def render_router_deployment(
    md: dict[str, Any], spec: dict[str, Any], images: Images, credentials: str | None = None
) -> dict[str, Any]:
    name = md["metadata"]["name"]
    router = spec["router"]
    mounts: list[dict[str, Any]] = [{"name": "tmp", "mountPath": "/tmp"}]
    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {}}]
    if router.get("apiKeySecretRef"):
        ref = router["apiKeySecretRef"]
        volumes.append(
            {
                "name": "api-keys",
                "secret": {
                    "secretName": ref["name"],
                    "items": [{"key": ref.get("key", "api-keys"), "path": "keys"}],
                },
            }
        )
        mounts.append({"name": "api-keys", "mountPath": "/etc/kvmesh/api-keys", "readOnly": True})
    if "pvc" in spec["model"]:
        vols, model_mounts = _model_volumes(spec)
        volumes += vols
        mounts += model_mounts
    container = {
        "name": "router",
        "image": router.get("image") or images.router,
        "imagePullPolicy": spec["engine"]["imagePullPolicy"],
        "command": router_args(spec, name),
        "ports": [
            {"name": "http", "containerPort": crd.ROUTER_PORT, "protocol": "TCP"},
            _METRICS_CONTAINER_PORT,
        ],
        "env": [
            _redis_env(name, spec),
            {"name": "HOME", "value": "/tmp"},
            {"name": "HF_HOME", "value": "/tmp/hf"},
        ]
        + (
            [_secret_env("KVMESH_UPSTREAM_API_KEY", names(name)["engine-api-key"], "api-key")]
            if spec["engine"]["requireApiKey"]
            else []
        ),
        "resources": _resources(router.get("resources"))
        or {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10},
        "lifecycle": {"preStop": {"sleep": {"seconds": ROUTER_PRESTOP_SLEEP_SECONDS}}},
        "volumeMounts": mounts,
        "securityContext": _container_security(),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(md, names(name)[ROUTER], ROUTER),
        "spec": {
            "replicas": int(router["replicas"]),
            "selector": {"matchLabels": selector(name, ROUTER)},
            "template": {
                "metadata": {
                    "labels": labels(name, ROUTER),
                    **_annotations(_credentials_annotation(credentials)),
                },
                # The router reads the engine Service's EndpointSlices with its own
                # ServiceAccount (a Role for exactly that).
                "spec": {
                    "serviceAccountName": names(name)[ROUTER],
                    "automountServiceAccountToken": True,
                    "securityContext": _pod_security(),
                    **_image_pull_secrets(spec),
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    }


ROUTER_RULES = [
    {
        "apiGroups": ["discovery.k8s.io"],
        "resources": ["endpointslices"],
        "verbs": ["get", "list", "watch"],
    }
]


def render_router_rbac(md: dict[str, Any]) -> list[dict[str, Any]]:
    """The router's identity: a ServiceAccount that may read EndpointSlices in this
    namespace, nothing else."""
    name = names(md["metadata"]["name"])[ROUTER]
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": _meta(md, name, ROUTER),
            "automountServiceAccountToken": False,
        },  # mounted by the router pod alone
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _meta(md, name, ROUTER),
            "rules": ROUTER_RULES,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _meta(md, name, ROUTER),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [
                {"kind": "ServiceAccount", "name": name, "namespace": md["metadata"]["namespace"]}
            ],
        },
    ]


def render_router_service(md: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    name = md["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(md, names(name)[ROUTER], ROUTER),
        "spec": {
            "type": spec["router"]["serviceType"],
            "selector": selector(name, ROUTER),
            "ports": [
                {"name": "http", "port": crd.ROUTER_PORT, "targetPort": "http", "protocol": "TCP"},
                _METRICS_SERVICE_PORT,
            ],
        },
    }


def render_redis(
    md: dict[str, Any], spec: dict[str, Any], images: Images, credentials: str | None = None
) -> list[dict[str, Any]]:
    name = md["metadata"]["name"]
    n = names(name)[REDIS]
    auth = spec["redis"]["requirePassword"]
    container = {
        "name": "redis",
        "image": spec["redis"].get("image") or images.redis,
        "imagePullPolicy": "IfNotPresent",
        # $(REDIS_PASSWORD) is expanded by the kubelet from the env below; it never appears in the spec.
        "args": ["--save", "", "--appendonly", "no", "--port", str(crd.REDIS_PORT)]
        + (["--requirepass", "$(REDIS_PASSWORD)"] if auth else []),
        **(
            {"env": [_secret_env("REDIS_PASSWORD", names(name)["redis-auth"], "password")]}
            if auth
            else {}
        ),
        "ports": [{"name": "redis", "containerPort": crd.REDIS_PORT, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "readinessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 10},
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
        "securityContext": _container_security(),
    }
    return [
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": _meta(md, n, REDIS),
            "spec": {
                "replicas": 1,
                "strategy": {"type": "Recreate"},
                "selector": {"matchLabels": selector(name, REDIS)},
                "template": {
                    "metadata": {
                        "labels": labels(name, REDIS),
                        **_annotations(_credentials_annotation(credentials)),
                    },
                    "spec": {
                        "securityContext": _pod_security(999),
                        "automountServiceAccountToken": False,
                        **_image_pull_secrets(spec),
                        "containers": [container],
                        "volumes": [{"name": "data", "emptyDir": {}}],
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(md, n, REDIS),
            "spec": {
                "selector": selector(name, REDIS),
                "ports": [
                    {
                        "name": "redis",
                        "port": crd.REDIS_PORT,
                        "targetPort": "redis",
                        "protocol": "TCP",
                    }
                ],
            },
        },
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": _meta(md, names(name)["redis-netpol"], REDIS),
            "spec": {
                "podSelector": {"matchLabels": selector(name, REDIS)},
                "policyTypes": ["Ingress"],
                # This deployment's sidecars and routers, and the operator (any namespace) only.
                "ingress": [
                    {
                        "from": [
                            {"podSelector": {"matchLabels": {LABEL_MD: name}}},
                            {
                                "namespaceSelector": {},
                                "podSelector": {"matchLabels": OPERATOR_POD_LABELS},
                            },
                        ],
                        "ports": [{"protocol": "TCP", "port": crd.REDIS_PORT}],
                    }
                ],
            },
        },
    ]


def render_redis_secret(md: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any] | None:
    """The Secret with the Redis URL, unless the user supplies their own (or the URL carries
    a generated password: then it is in the generated <name>-redis-auth Secret)."""
    name, ns = md["metadata"]["name"], md["metadata"]["namespace"]
    redis = spec["redis"]
    if redis["mode"] == "managed" and redis["requirePassword"]:
        return None
    if redis["mode"] == "managed":
        url = managed_redis_url(name, ns)
    elif "url" in redis:
        url = redis["url"]
    else:
        return None
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(md, names(name)["redis-secret"], "redis"),
        "type": "Opaque",
        "data": {"url": base64.b64encode(url.encode()).decode()},
    }


def render_network_policy(md: dict[str, Any], spec: dict[str, Any] | None = None) -> dict[str, Any]:
    """Only this deployment's routers reach the engines' API (and, with LoRA, the operator,
    which loads and unloads adapters); pods labelled as metrics scrapers (or in a namespace
    labelled so) reach their metrics port alone."""
    name = md["metadata"]["name"]
    scraper = {LABEL_SCRAPER: "true"}
    api_from: list[dict[str, Any]] = [{"podSelector": {"matchLabels": selector(name, ROUTER)}}]
    if spec is not None and lora.enabled(spec):
        api_from.append(
            {"namespaceSelector": {}, "podSelector": {"matchLabels": OPERATOR_POD_LABELS}}
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(md, names(name)["netpol"], ENGINE),
        "spec": {
            "podSelector": {"matchLabels": selector(name, ENGINE)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": api_from, "ports": [{"protocol": "TCP", "port": crd.ENGINE_PORT}]},
                # Scrapers reach the metrics-only port, never the API.
                {
                    "from": [
                        {"podSelector": {"matchLabels": scraper}},
                        {"namespaceSelector": {"matchLabels": scraper}},
                    ],
                    "ports": [{"protocol": "TCP", "port": METRICS_PORT}],
                },
            ],
        },
    }


def render_children(
    md: dict[str, Any],
    spec: dict[str, Any],
    images: Images = Images(),
    credentials: str | None = None,
) -> list[dict[str, Any]]:
    """Every child of a ModelDeployment ``md`` with the defaulted, validated ``spec``.
    ``credentials`` identifies the generated Secrets' current versions (pods roll when it
    changes); the generated Secrets themselves are not rendered (see generated_secret)."""
    children = [
        *render_adapters_config(md, spec),  # before the engines that mount it
        render_engine_deployment(md, spec, images, credentials),
        render_engine_service(md),
        render_router_deployment(md, spec, images, credentials),
        render_router_service(md, spec),
        *render_router_rbac(md),
        render_network_policy(md, spec),
    ]
    secret = render_redis_secret(md, spec)
    if secret is not None:
        children.append(secret)
    if spec["redis"]["mode"] == "managed":
        children += render_redis(md, spec, images, credentials)
    children += render_pdbs(md, spec) + render_model_cache(md, spec, images)
    return children + render_adapter_fetches(md, spec, images)


def command_line(args: list[str]) -> str:
    """For docs and logs."""
    return shlex.join(args)
