"""The ModelDeployment custom resource: the one source of truth for its schema.

Everything else is generated from the data in this module:

* ``manifests/crd.yaml`` and ``charts/kvmesh/crds/modeldeployments.kvmesh.io.yaml``
  (``python -m kvmesh.operator.generate``; a test asserts the files are up to date),
* the operator's own defaulting (:func:`kvmesh.operator.spec.apply_defaults`) and
  validation (:func:`kvmesh.operator.spec.validate`), so a cluster that skipped the
  admission-time checks (or an older API server without CEL) still gets a clear
  ``Ready=False`` condition instead of broken pods.

Engine defaults equal ``kvmesh serve``'s defaults (docs/cli.md).
"""

from __future__ import annotations

import copy
from typing import Any

from kvmesh.common import block_keys as _block_keys
from kvmesh.common import flow_bands as _flow_bands
from kvmesh.common import model_lookup as _model_lookup
from kvmesh.common import policy_names as _policies

GROUP = "kvmesh.io"
VERSION = "v1alpha1"
KIND = "ModelDeployment"
PLURAL = "modeldeployments"
SINGULAR = "modeldeployment"
SHORT_NAMES = ["md"]
CRD_NAME = f"{PLURAL}.{GROUP}"
API_VERSION = f"{GROUP}/{VERSION}"


def object_ref(body: Any) -> dict[str, Any]:
    """The reference to one ModelDeployment that the Events about it carry."""
    meta = body["metadata"]
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"]},
    }


# Engine defaults: the same as `kvmesh serve` (docs/cli.md); the model and block size are the
# shared contracts' (kvmesh/common), the routing policies' names kvmesh/common/policy_names.py.
DEFAULT_MODEL = _model_lookup.DEFAULT_MODEL
DEFAULT_BLOCK_SIZE = _block_keys.DEFAULT_BLOCK_SIZE
DEFAULT_MAX_NUM_SEQS = 128
DEFAULT_DRAIN_TIMEOUT = 30
DEFAULT_GRACE_PERIOD = 60
DEFAULT_PRESTOP_SLEEP = 5  # let heartbeats/endpoints drop the pod before SIGTERM
ENGINE_PORT = 8000
ROUTER_PORT = 8000
REDIS_PORT = 6379


def _str(desc: str, **kw: Any) -> dict[str, Any]:
    return {"type": "string", "description": desc, **kw}


def _int(desc: str, **kw: Any) -> dict[str, Any]:
    return {"type": "integer", "description": desc, **kw}


def _num(desc: str, **kw: Any) -> dict[str, Any]:
    return {"type": "number", "description": desc, **kw}


def _bool(desc: str, **kw: Any) -> dict[str, Any]:
    return {"type": "boolean", "description": desc, **kw}


def _obj(desc: str, props: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {"type": "object", "description": desc, "properties": props, **kw}


def _secret_ref(desc: str, default_key: str) -> dict[str, Any]:
    return _obj(
        desc,
        {
            "name": _str("Secret name (same namespace).", minLength=1),
            "key": _str("Key inside the Secret.", default=default_key),
        },
        required=["name"],
    )


_QUANTITY = {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}
# A structural schema allows no value checks inside anyOf branches: the check is a CEL rule.
_INT_OR_PERCENT = {
    "anyOf": [{"type": "integer"}, {"type": "string"}],
    "x-kubernetes-int-or-string": True,
    "x-kubernetes-validations": [
        {
            "rule": "type(self) == int ? self >= 0 : self.matches('^[0-9]+%$')",
            "message": "must be a non-negative integer or a percentage such as 25%",
        }
    ],
}
# Kubernetes core types passed through to the pod template as the user wrote them
# (the API server validates them when the operator applies the Deployment).
_K8S_LIST = {
    "type": "array",
    "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
}
_K8S_OBJECT = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


def _k8s_list(desc: str) -> dict[str, Any]:
    return {**copy.deepcopy(_K8S_LIST), "description": desc}


def _k8s_object(desc: str) -> dict[str, Any]:
    return {**copy.deepcopy(_K8S_OBJECT), "description": desc}


def _probe(desc: str, period: int, failures: int, timeout: int = 1) -> dict[str, Any]:
    return _obj(
        desc,
        {
            "periodSeconds": _int("How often to probe.", default=period, minimum=1),
            "failureThreshold": _int(
                "Failures in a row before the probe fails.", default=failures, minimum=1
            ),
            "timeoutSeconds": _int("Probe timeout.", default=timeout, minimum=1),
            "initialDelaySeconds": _int("Delay before the first probe.", default=0, minimum=0),
        },
        default={},
    )


_TOLERATION = _obj(
    "A toleration (core/v1 Toleration).",
    {
        "key": _str("Taint key; empty with operator Exists matches every taint."),
        "operator": _str("Exists or Equal.", enum=["Exists", "Equal"]),
        "value": _str("Taint value (operator Equal)."),
        "effect": _str(
            "Taint effect; empty matches all.",
            enum=["", "NoSchedule", "PreferNoSchedule", "NoExecute"],
        ),
        "tolerationSeconds": _int("How long a NoExecute taint is tolerated."),
    },
)

# (CEL rule, message) pairs. Each rule is mirrored in spec.py's Python checks and
# evaluated by the tests with a CEL interpreter against the same examples.
# Every rule reads optional keys only behind has(): the API server validates the schema's
# own defaults (e.g. `engine: {}` before its nested defaults apply) against these rules.
SPEC_RULES: list[dict[str, str]] = []
MODEL_RULES = [
    {
        "rule": "(has(self.builtin) ? 1 : 0) + (has(self.huggingFace) ? 1 : 0) + (has(self.pvc) ? 1 : 0) == 1",
        "message": "set exactly one model source: builtin, huggingFace or pvc",
    },
]
ENGINE_RULES = [
    {
        "rule": f"!has(self.drainTimeoutSeconds) || !has(self.terminationGracePeriodSeconds) || "
        f"self.drainTimeoutSeconds + (has(self.preStopSleepSeconds) ? self.preStopSleepSeconds : "
        f"{DEFAULT_PRESTOP_SLEEP}) < self.terminationGracePeriodSeconds",
        "message": "drainTimeoutSeconds + preStopSleepSeconds must be less than terminationGracePeriodSeconds",
    },
]
ROLLOUT_RULES = [
    {
        "rule": "!has(self.maxSurge) || !has(self.maxUnavailable) || "
        "!(string(self.maxSurge) in ['0', '0%'] && string(self.maxUnavailable) in ['0', '0%'])",
        "message": "rollout.maxSurge and rollout.maxUnavailable cannot both be 0: the rollout could never progress",
    },
]
AUTOSCALING_RULES = [
    {
        "rule": "!has(self.minReplicas) || self.minReplicas <= self.maxReplicas",
        "message": "autoscaling.minReplicas must be <= autoscaling.maxReplicas",
    },
]
REDIS_RULES = [
    {
        "rule": "!has(self.mode) || self.mode != 'external' || has(self.url) || has(self.secretRef)",
        "message": "external Redis needs a url or a secretRef",
    },
    {
        "rule": "!has(self.url) || !self.url.matches('^rediss?://[^/]*@')",
        "message": "redis.url must not carry credentials: put the URL in a Secret and use redis.secretRef",
    },
]


FLOW_RULES = [
    {
        "rule": "!has(self.bands) || self.bands.all(b, self.bands.exists_one(c, c.name == b.name))",
        "message": "router.flowControl.bands: band names must be unique",
    },
    {
        "rule": "!has(self.bands) || self.bands.all(b, self.bands.exists_one(c, c.priority == b.priority))",
        "message": "router.flowControl.bands: band priorities must be unique",
    },
    {
        "rule": "!has(self.bands) || !has(self.defaultBand) || self.bands.exists(b, b.name == self.defaultBand)",
        "message": "router.flowControl.defaultBand must name one of the bands",
    },
]

_FLOW_BAND = _obj(
    "A priority band (--flow-band NAME:PRIORITY:WEIGHT:MAX_QUEUED).",
    {
        "name": _str(
            "Band name (what x-gateway-inference-objective and a key's band= name).",
            pattern="^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$",
            maxLength=32,
        ),
        "priority": _int("A higher priority is dispatched first and shed last."),
        "weight": _num(
            "Fair-share weight of a tenant in this band (an API key's weight= overrides).",
            default=1.0,
            exclusiveMinimum=True,
            minimum=0,
        ),
        "maxQueued": _int("Requests that may wait in this band.", default=256, minimum=0),
    },
    required=["name", "priority"],
)

# spec.router.flowControl: rendered into the router's --flow-* flags (operator/render.py).
FLOW_CONTROL = _obj(
    "Flow control at the router: while every engine replica is saturated, requests wait at "
    "the router in a bounded queue per priority band, dispatched highest band first and, in a "
    "band, to the tenant (API key, or x-gateway-inference-fairness-id) with the least service. "
    "Off unless enabled.",
    {
        "enabled": _bool("Turn flow control on (--flow-control).", default=False),
        "bands": {
            "type": "array",
            "description": "The priority bands (--flow-band); names and priorities unique.",
            "items": _FLOW_BAND,
            "minItems": 1,
            "maxItems": 16,
            "default": [
                {"name": n, "priority": p, "weight": w, "maxQueued": q}
                for n, p, w, q in _flow_bands.DEFAULT_BANDS
            ],
        },
        "defaultBand": _str(
            "Band of requests that name none (--flow-default-band).",
            default=_flow_bands.DEFAULT_BAND,
            maxLength=32,
        ),
        "maxQueued": _int(
            "Requests waiting, all bands together (--flow-max-queued); the lowest band is shed first.",
            default=_flow_bands.MAX_QUEUED,
            minimum=0,
        ),
        "deadlineSeconds": _num(
            "Longest wait at the router before a 503 (--flow-deadline; default: 60).",
            exclusiveMinimum=True,
            minimum=0,
        ),
        "kvThreshold": _num(
            "A replica at or above this KV usage is saturated (--flow-kv-threshold).",
            default=0.8,
            minimum=0,
            maximum=1,
        ),
        "queueThreshold": _int(
            "A replica with this many requests waiting in its engine is saturated "
            "(--flow-queue-threshold).",
            default=5,
            minimum=1,
        ),
        "podMaxInflight": _int(
            "A replica with this many of a router's requests on it is saturated "
            "(--flow-pod-max-inflight); 0: no cap.",
            default=0,
            minimum=0,
        ),
        "maxTenants": _int(
            "Tenants tracked for fair share; more share one 'other' flow (--flow-max-tenants).",
            default=1024,
            minimum=1,
        ),
    },
    default={},
    **{"x-kubernetes-validations": FLOW_RULES},
)

MAX_ADAPTERS = 64
LORA_RANKS = [1, 8, 16, 32, 64, 128, 256, 320, 512]  # vLLM's --max-lora-rank choices
ADAPTER_NAME_RULES = [
    {
        "rule": "self.matches('^[A-Za-z0-9]([A-Za-z0-9._/-]*[A-Za-z0-9])?$')",
        "message": "an adapter name is letters, digits and . _ / - (no spaces, no '='), "
        "starting and ending with a letter or digit",
    },
]
ADAPTER_SOURCE_RULES = [
    {
        "rule": "(has(self.huggingFace) ? 1 : 0) + (has(self.pvc) ? 1 : 0) + (has(self.path) ? 1 : 0) == 1",
        "message": "set exactly one adapter source: huggingFace, pvc or path",
    },
]
ADAPTERS_RULES = [
    {
        "rule": "self.all(a, self.exists_one(b, b.name == a.name))",
        "message": "adapters: names must be unique",
    },
]
LORA_RULES = [
    {
        "rule": "!has(self.maxCpuLoras) || self.maxCpuLoras >= (has(self.maxLoras) ? self.maxLoras : 1)",
        "message": "lora.maxCpuLoras must be >= lora.maxLoras",
    },
]


def _adapter_name() -> dict[str, Any]:
    return _str(
        "The adapter's served name: a request names it as its model.",
        minLength=1,
        maxLength=253,
        **{"x-kubernetes-validations": ADAPTER_NAME_RULES},
    )


# The model's source kinds, for an adapter: the same Hugging Face and PVC fields (fetched and
# mounted the same way), or a path the engine reads as it is (local clusters, tests).
ADAPTER_SOURCE = _obj(
    "Where the adapter's files come from. Exactly one source.",
    {
        "huggingFace": _obj(
            "A Hugging Face repository, downloaded once into the model's shared cache.",
            {
                "repoId": _str("Repository id.", minLength=1, maxLength=256),
                "revision": _str("Branch, tag or commit.", default="main", maxLength=256),
                "tokenSecretRef": _secret_ref(
                    "Secret holding a Hugging Face token (gated adapters).", "HF_TOKEN"
                ),
            },
            required=["repoId"],
        ),
        "pvc": _obj(
            "An adapter directory on an existing PersistentVolumeClaim (mounted read-only).",
            {
                "claimName": _str("PersistentVolumeClaim name.", minLength=1, maxLength=253),
                "path": _str("Directory inside the volume.", default="", maxLength=1024),
            },
            required=["claimName"],
        ),
        "path": _str(
            "A directory the engine container reads as it is.", minLength=1, maxLength=1024
        ),
    },
    **{"x-kubernetes-validations": ADAPTER_SOURCE_RULES},
)

ADAPTERS = {
    "type": "array",
    "description": "LoRA adapters served beside the model (--enable-lora); a request names one "
    "as its model. Adding or removing one loads or unloads it on the running replicas (no "
    "restart); a new replica starts with the whole list.",
    "maxItems": MAX_ADAPTERS,
    "items": _obj(
        "A LoRA adapter.",
        {"name": _adapter_name(), "source": ADAPTER_SOURCE},
        required=["name", "source"],
    ),
    "x-kubernetes-validations": ADAPTERS_RULES,
}

LORA = _obj(
    "LoRA serving limits (--max-loras, --max-cpu-loras, --max-lora-rank). Setting it (even {}) "
    "turns LoRA on with no adapter yet, so the first one added needs no restart.",
    {
        "maxLoras": _int(
            "Distinct adapters in one batch (--max-loras).", default=1, minimum=1, maximum=256
        ),
        "maxCpuLoras": _int(
            "Adapters kept loaded (--max-cpu-loras); default: maxLoras.", minimum=1, maximum=1024
        ),
        "maxRank": _int(
            "Highest adapter rank accepted (--max-lora-rank).", default=16, enum=LORA_RANKS
        ),
    },
    **{"x-kubernetes-validations": LORA_RULES},
)


# spec.engine.kvOffload: the engine's KV tiers (operator/kv_offload.py renders them).
DEFAULT_KV_SHARED_SIZE = "10Gi"
KV_SHARED_SOURCES = ("emptyDir", "hostPath", "persistentVolumeClaim")
KV_SHARED_VOLUME_RULES = [
    {
        "rule": " + ".join(f"(has(self.{k}) ? 1 : 0)" for k in KV_SHARED_SOURCES) + " == 1",
        "message": "engine.kvOffload.shared.volume: set exactly one volume source: "
        "emptyDir, hostPath or persistentVolumeClaim",
    },
]
# A memory size: a Kubernetes quantity without fractions of a byte (8Gi, 512Mi, 20G).
SIZE_PATTERN = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"


def _size(desc: str, **kw: Any) -> dict[str, Any]:
    return _str(desc, pattern=SIZE_PATTERN, maxLength=32, **kw)


KV_OFFLOAD = _obj(
    "KV tiers beyond the engine's KV cache: blocks it evicts are kept in host memory and, with "
    "shared, in a store on a volume, and loaded back on a prefix hit instead of prefilled "
    "again. A change rolls the engine pods.",
    {
        "hostMemory": _size(
            "Host memory of the host tier, e.g. 8Gi (--kv-offloading-size, in GiB); added to "
            "the engine container's memory request and limit where they are set."
        ),
        "shared": _obj(
            "A shared tier: one file per block key on a volume the replicas mount at "
            "/var/lib/kvmesh/kv-shared (--kv-shared-dir); kvmesh engines only.",
            {
                "volume": _obj(
                    "The volume. Exactly one source; a volume every replica mounts (a "
                    "ReadWriteMany claim) shares blocks between them.",
                    {
                        "emptyDir": _obj(
                            "A volume of the pod's own (kept across engine restarts).",
                            {"sizeLimit": _size("Size limit of the emptyDir.")},
                        ),
                        "hostPath": _obj(
                            "A directory of the node (shared by the replicas on that node).",
                            {
                                "path": _str(
                                    "Absolute path on the node.",
                                    pattern="^/",
                                    minLength=1,
                                    maxLength=1024,
                                ),
                                "type": _str(
                                    "hostPath type.",
                                    enum=["", "DirectoryOrCreate", "Directory"],
                                ),
                            },
                            required=["path"],
                        ),
                        "persistentVolumeClaim": _obj(
                            "An existing PersistentVolumeClaim.",
                            {
                                "claimName": _str(
                                    "PersistentVolumeClaim name.", minLength=1, maxLength=253
                                )
                            },
                            required=["claimName"],
                        ),
                    },
                    **{"x-kubernetes-validations": KV_SHARED_VOLUME_RULES},
                ),
                "size": _size(
                    "Most bytes the engine keeps in the store, least recently used dropped "
                    "first (--kv-shared-size, in GiB).",
                    default=DEFAULT_KV_SHARED_SIZE,
                ),
            },
            required=["volume"],
        ),
    },
)


SPEC_SCHEMA: dict[str, Any] = _obj(
    "Desired state of a served model.",
    {
        "model": _obj(
            "Where the weights come from. Exactly one source.",
            {
                "servedModelName": _str(
                    "Model name clients ask for (and the block-key identity). "
                    "Default: the builtin name, the Hugging Face repo id, or the PVC path.",
                    maxLength=253,
                ),
                "builtin": _str(
                    f"A model built into the engine image, e.g. {DEFAULT_MODEL}.", minLength=1
                ),
                "huggingFace": _obj(
                    "A Hugging Face repository, downloaded by an init container into a volume.",
                    {
                        "repoId": _str(
                            "Repository id, e.g. HuggingFaceTB/SmolLM2-135M-Instruct.", minLength=1
                        ),
                        "revision": _str("Branch, tag or commit.", default="main"),
                        "tokenSecretRef": _secret_ref(
                            "Secret holding a Hugging Face token (gated models).", "HF_TOKEN"
                        ),
                        "cacheSize": _str(
                            "Size of the download volume (emptyDir limit, or the shared cache's claim).",
                            default="50Gi",
                        ),
                        "sharedCache": _obj(
                            "Download the model once into an operator-managed PersistentVolumeClaim "
                            "(filled by a Job, mounted read-only by every engine), so scale-up does "
                            "not download it again.",
                            {
                                "enabled": _bool("Use the shared cache.", default=False),
                                "storageClassName": _str(
                                    "StorageClass of the claim; empty means the cluster default."
                                ),
                                "accessMode": _str(
                                    "Access mode of the claim: ReadWriteMany lets engines on any node mount it.",
                                    enum=["ReadWriteMany", "ReadWriteOnce", "ReadWriteOncePod"],
                                    default="ReadWriteMany",
                                ),
                            },
                            default={},
                        ),
                    },
                    required=["repoId"],
                ),
                "pvc": _obj(
                    "A Hugging Face directory on an existing PersistentVolumeClaim (mounted read-only).",
                    {
                        "claimName": _str("PersistentVolumeClaim name.", minLength=1),
                        "path": _str("Directory inside the volume.", default=""),
                    },
                    required=["claimName"],
                ),
            },
            **{"x-kubernetes-validations": MODEL_RULES},
        ),
        "engine": _obj(
            "Engine container settings (flags of `kvmesh serve`, or of `vllm serve` with kind vllm).",
            {
                "kind": _str(
                    "The engine: kvmesh (`kvmesh serve`) or vllm (`vllm serve`, the pinned "
                    "vllm/vllm-openai image unless image is set; docs/vllm.md).",
                    enum=["kvmesh", "vllm"],
                    default="kvmesh",
                ),
                "image": _str("Engine image; empty means the operator's default for the kind."),
                "imagePullPolicy": _str(
                    "Image pull policy.",
                    enum=["Always", "IfNotPresent", "Never"],
                    default="IfNotPresent",
                ),
                "extraArgs": {
                    "type": "array",
                    "items": {"type": "string"},
                    "description": "Extra `kvmesh serve` arguments, appended last.",
                },
                "blockSize": _int(
                    "Tokens per KV block (--block-size).",
                    default=DEFAULT_BLOCK_SIZE,
                    minimum=1,
                    maximum=1024,
                ),
                "maxNumBatchedTokens": _int(
                    "Token budget per engine step (--max-num-batched-tokens); default: "
                    "the engine's (2048 on a GPU, 512 on the CPU).",
                    minimum=1,
                ),
                "maxNumSeqs": _int(
                    "Most requests running at once (--max-num-seqs).",
                    default=DEFAULT_MAX_NUM_SEQS,
                    minimum=1,
                ),
                "maxModelLen": _int(
                    "Longest prompt + output (--max-model-len); default: the model's.", minimum=1
                ),
                "enablePrefixCaching": _bool(
                    "Prefix caching (--enable-prefix-caching).", default=True
                ),
                "enableChunkedPrefill": _bool(
                    "Chunked prefill (--enable-chunked-prefill).", default=True
                ),
                "dtype": _str(
                    "Weights/activations dtype (--dtype).",
                    enum=["auto", "float32", "bfloat16", "float16"],
                    default="auto",
                ),
                "kvCacheMemory": _str(
                    "KV cache size in bytes, e.g. 2GiB (--kv-cache-memory; vLLM: "
                    "--kv-cache-memory-bytes)."
                ),
                "gpuMemoryUtilization": _num(
                    "vLLM: the fraction of GPU memory for weights and KV cache "
                    "(--gpu-memory-utilization; ignored when kvCacheMemory is set).",
                    minimum=0.01,
                    maximum=1,
                ),
                "toolCallParser": _str(
                    "Tool-call parser (--enable-auto-tool-choice --tool-call-parser), e.g. hermes; "
                    "the router renders tool requests the same way."
                ),
                "loraModules": {
                    "type": "array",
                    "description": "Deprecated alias of spec.adapters: each {name, path} is the "
                    "adapter {name, source: {path}}; names unique across both lists.",
                    "maxItems": MAX_ADAPTERS,
                    "items": _obj(
                        "A LoRA adapter.",
                        {
                            "name": _adapter_name(),
                            "path": _str(
                                "Its directory (or, vLLM, a Hugging Face repo).",
                                minLength=1,
                                maxLength=1024,
                            ),
                        },
                        required=["name", "path"],
                    ),
                },
                "drainTimeoutSeconds": _int(
                    "On shutdown, how long in-flight requests may finish (--drain-timeout).",
                    default=DEFAULT_DRAIN_TIMEOUT,
                    minimum=0,
                ),
                "preStopSleepSeconds": _int(
                    "preStop sleep before SIGTERM, so routers and endpoints drop the pod first.",
                    default=DEFAULT_PRESTOP_SLEEP,
                    minimum=0,
                ),
                "terminationGracePeriodSeconds": _int(
                    "Pod grace period; must exceed drain timeout + preStop sleep.",
                    default=DEFAULT_GRACE_PERIOD,
                    minimum=1,
                ),
                "rollout": _obj(
                    "How a change of model, image or arguments replaces the engines.",
                    {
                        "strategy": _str(
                            "RollingUpdate surges new pods before old ones go (the router serves from the "
                            "old ones until the new are ready); Recreate stops all first (GPU-full clusters).",
                            enum=["RollingUpdate", "Recreate"],
                            default="RollingUpdate",
                        ),
                        "maxSurge": {
                            **_INT_OR_PERCENT,
                            "description": "RollingUpdate: extra pods during a rollout.",
                            "default": 1,
                        },
                        "maxUnavailable": {
                            **_INT_OR_PERCENT,
                            "description": "RollingUpdate: pods that may be unavailable.",
                            "default": 0,
                        },
                    },
                    default={},
                    **{"x-kubernetes-validations": ROLLOUT_RULES},
                ),
                "podDisruptionBudget": _obj(
                    "PodDisruptionBudget of the engines (voluntary evictions, node drains).",
                    {
                        "enabled": _bool("Render the budget.", default=True),
                        "maxUnavailable": {
                            **_INT_OR_PERCENT,
                            "description": "Engines a drain may evict at once.",
                            "default": 1,
                        },
                    },
                    default={},
                ),
                "probes": _obj(
                    "Probe timing; the startup probe covers model loading.",
                    {
                        "startup": _probe(
                            "Startup probe on /health (period x failures = time allowed to load).",
                            5,
                            120,
                        ),
                        "readiness": _probe("Readiness probe on /ready.", 2, 2),
                        "liveness": _probe("Liveness probe on /health.", 10, 3),
                    },
                    default={},
                ),
                "env": _k8s_list(
                    "Extra environment variables of the engine container (core/v1 EnvVar)."
                ),
                "envFrom": _k8s_list(
                    "Extra env sources of the engine container (core/v1 EnvFromSource)."
                ),
                "volumes": _k8s_list("Extra pod volumes (core/v1 Volume)."),
                "volumeMounts": _k8s_list(
                    "Extra engine container volume mounts (core/v1 VolumeMount)."
                ),
                "imagePullSecrets": {
                    "type": "array",
                    "description": "Pull secrets of every pod the operator runs.",
                    "items": _obj(
                        "A Secret reference.",
                        {"name": _str("Secret name.", minLength=1)},
                        required=["name"],
                    ),
                },
                "affinity": _k8s_object("Engine pod affinity (core/v1 Affinity)."),
                "topologySpreadConstraints": _k8s_list(
                    "Engine pod topology spread (core/v1 TopologySpreadConstraint)."
                ),
                "priorityClassName": _str("Engine pod priority class."),
                "runtimeClassName": _str("Engine pod runtime class (e.g. nvidia)."),
                "resources": _obj(
                    "Container resources, e.g. limits: {nvidia.com/gpu: 1}.",
                    {
                        "requests": {"type": "object", "additionalProperties": _QUANTITY},
                        "limits": {"type": "object", "additionalProperties": _QUANTITY},
                    },
                ),
                "shmSize": _str("Size of the in-memory /dev/shm.", default="1Gi"),
                "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
                "tolerations": {
                    "type": "array",
                    "items": _TOLERATION,
                    "description": "Engine pod tolerations.",
                },
                "heartbeatIntervalSeconds": _num(
                    "Sidecar heartbeat interval.", default=1, minimum=0.1
                ),
                "kvOffload": KV_OFFLOAD,
                "requireApiKey": _bool(
                    "Engines accept /v1 requests only with a generated key (Secret "
                    "<name>-engine-api-key), which the router sends: nothing but the router "
                    "can use the engines' API.",
                    default=True,
                ),
            },
            default={},
            **{"x-kubernetes-validations": ENGINE_RULES},
        ),
        "adapters": ADAPTERS,
        "lora": LORA,
        "replicas": _int(
            "Engine replicas: the scale subresource's target. Without autoscaling the user sets it; "
            "with autoscaling.mode builtin the operator's autoscaler writes it; with external an "
            "HPA or KEDA does. Kept within [minReplicas, maxReplicas] when autoscaling.",
            default=1,
            minimum=0,
        ),
        "autoscaling": _obj(
            "Scale engine replicas on KV-cache utilisation and queue depth.",
            {
                "mode": _str(
                    "builtin: the operator's autoscaler sets spec.replicas; external: an HPA or KEDA "
                    "ScaledObject pointed at this ModelDeployment's scale subresource does.",
                    enum=["builtin", "external"],
                    default="builtin",
                ),
                "minReplicas": _int(
                    "Lower bound; 0 allows scale to zero (the router holds requests and asks "
                    "for a replica).",
                    default=1,
                    minimum=0,
                ),
                "maxReplicas": _int("Upper bound.", minimum=1),
                "targetKVUtilization": _num(
                    "Target mean KV utilisation of ready replicas (0..1].",
                    default=0.7,
                    exclusiveMinimum=True,
                    minimum=0,
                    maximum=1,
                ),
                "targetQueuePerReplica": _num(
                    "Target waiting requests per replica (0 disables the queue signal).",
                    default=4,
                    minimum=0,
                ),
                "tolerance": _num(
                    "No change while |utilisation/target - 1| <= tolerance.",
                    default=0.1,
                    minimum=0,
                    maximum=1,
                ),
                "scaleUpStabilizationSeconds": _int(
                    "Scale up to the lowest recommendation of this window.", default=0, minimum=0
                ),
                "scaleDownStabilizationSeconds": _int(
                    "Scale down to the highest recommendation of this window.",
                    default=300,
                    minimum=0,
                ),
                "maxScaleDownStep": _int(
                    "Most replicas removed in one decision.", default=1, minimum=1
                ),
                "scaleUpPercent": _int(
                    "Scale-up cap per period, in percent of the current replicas "
                    "(HPA's default policy: 100).",
                    default=100,
                    minimum=1,
                ),
                "scaleUpPods": _int(
                    "Scale-up cap per period, in pods; the larger of the two caps applies "
                    "(HPA's default policy: 4).",
                    default=4,
                    minimum=1,
                ),
                "scaleUpPeriodSeconds": _int("Period of the scale-up caps.", default=15, minimum=1),
                "startupTimeoutSeconds": _int(
                    "A replica not ready this long after its pod was created stops counting "
                    "as coming capacity (and is reported).",
                    default=600,
                    minimum=1,
                ),
                "scaleToZeroIdleSeconds": _int(
                    "With minReplicas 0: scale to zero after this long with no request "
                    "running, waiting or held by a router.",
                    default=300,
                    minimum=0,
                ),
                "intervalSeconds": _num(
                    "How often the autoscaler decides.", default=15, minimum=0.1
                ),
            },
            required=["maxReplicas"],
            **{"x-kubernetes-validations": AUTOSCALING_RULES},
        ),
        "router": _obj(
            "The prefix-aware router in front of the engines.",
            {
                "replicas": _int("Router replicas.", default=1, minimum=0),
                "image": _str(
                    "Router image; empty means the operator's default (also used for the sidecar)."
                ),
                "policy": _str(
                    "Routing policy (--policy).",
                    enum=list(_policies.NAMES),
                    default=_policies.DEFAULT,
                ),
                "weights": _obj(
                    "Routing-score weights (--weights).",
                    {
                        "prefix": _num("Weight of the prefix match.", default=1.0, minimum=0),
                        "kv": _num("Weight of the KV usage.", default=0.5, minimum=0),
                        "queue": _num("Weight of the queue share.", default=0.5, minimum=0),
                    },
                    default={},
                ),
                "apiKeySecretRef": _secret_ref("Secret with API keys, one per line.", "api-keys"),
                "maxResumes": _int(
                    "Times a request whose engine failed mid-stream (or before answering) goes on with "
                    "another replica from the tokens its client received (--max-resumes); 0: never.",
                    default=2,
                    minimum=0,
                    maximum=16,
                ),
                "resumeTimeoutSeconds": _num(
                    "How long such a request waits for a replica when none is routable, e.g. "
                    "the only engine restarting in place (--resume-timeout); 0: the error at "
                    "once.",
                    default=60,
                    minimum=0,
                    maximum=3600,
                ),
                "flowControl": FLOW_CONTROL,
                "serviceType": _str(
                    "Router Service type.",
                    enum=["ClusterIP", "NodePort", "LoadBalancer"],
                    default="ClusterIP",
                ),
                "resources": _obj(
                    "Router container resources.",
                    {
                        "requests": {"type": "object", "additionalProperties": _QUANTITY},
                        "limits": {"type": "object", "additionalProperties": _QUANTITY},
                    },
                ),
                "podDisruptionBudget": _obj(
                    "PodDisruptionBudget of the routers (rendered with 2 or more replicas).",
                    {
                        "enabled": _bool("Render the budget.", default=True),
                        "maxUnavailable": {
                            **_INT_OR_PERCENT,
                            "description": "Routers a drain may evict at once.",
                            "default": 1,
                        },
                    },
                    default={},
                ),
            },
            default={},
        ),
        "redis": _obj(
            "The Redis the sidecars write and the router reads.",
            {
                "mode": _str(
                    "managed: the operator runs one; external: use url or secretRef.",
                    enum=["managed", "external"],
                    default="managed",
                ),
                "url": _str(
                    "redis:// URL of an external Redis without credentials (use secretRef for a URL "
                    "with a password).",
                    pattern=r"^rediss?://",
                    maxLength=2048,
                ),
                "secretRef": _secret_ref("Secret holding the external Redis URL.", "url"),
                "image": _str("Managed Redis image; empty means the operator's default."),
                "requirePassword": _bool(
                    "Managed Redis requires a generated password (Secret <name>-redis-auth, "
                    "keys password and url); only this deployment's pods and the operator "
                    "may connect (NetworkPolicy).",
                    default=True,
                ),
            },
            default={},
            **{"x-kubernetes-validations": REDIS_RULES},
        ),
    },
    required=["model"],
    **{"x-kubernetes-validations": SPEC_RULES},
)

_CONDITION = _obj(
    "A condition.",
    {
        "type": _str("Ready, Progressing or Degraded."),
        "status": _str("True, False or Unknown.", enum=["True", "False", "Unknown"]),
        "reason": _str("CamelCase reason."),
        "message": _str("Human-readable detail."),
        "lastTransitionTime": _str("When the status last changed.", format="date-time"),
        "observedGeneration": _int("Generation this condition reflects."),
    },
    required=["type", "status"],
)

_DECISION = _obj(
    "An autoscaling decision.",
    {
        "time": _str("When it was taken.", format="date-time"),
        "action": _str("scale-up, scale-down, hold or none."),
        "currentReplicas": _int("Replicas before."),
        "desiredReplicas": _int("Replicas after."),
        "recommendation": _int("Raw recommendation before stabilisation and bounds."),
        "kvUtilization": _num("Mean KV utilisation of ready replicas, if known."),
        "readyReplicas": _int("Replicas that served when it was taken."),
        "waitingRequests": _int("Requests waiting on the replicas (the queue signal), if known."),
        "runningRequests": _int("Requests running on the replicas."),
        "stuckPods": {
            "type": "array",
            "items": {"type": "string"},
            "description": "Pods not Ready within startupTimeoutSeconds (not counted as coming capacity).",
        },
        "demand": _bool("A router held requests for lack of a ready replica (scale from zero)."),
        "reason": _str("Why."),
    },
)

_ADAPTER_STATUS = _obj(
    "An adapter's state.",
    {
        "name": _str("The adapter."),
        "state": _str("Loaded (on every ready replica), Loading, Fetching or Failed."),
        "loadedReplicas": _int("Ready replicas that serve it."),
        "replicas": {
            "type": "array",
            "description": "Per ready replica: its state, and the reason of a failure.",
            "items": _obj(
                "One replica.",
                {
                    "pod": _str("The engine pod."),
                    "state": _str("loaded, loading, fetching or failed."),
                    "reason": _str("Why a load failed."),
                },
            ),
        },
    },
)

STATUS_SCHEMA: dict[str, Any] = _obj(
    "Observed state.",
    {
        "observedGeneration": _int("The spec generation last reconciled."),
        "conditions": {
            "type": "array",
            "items": _CONDITION,
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
        "model": _str("Served model name."),
        "replicas": _int("Engine pods that exist."),
        "readyReplicas": _int("Engine pods that are ready."),
        "desiredReplicas": _int("Engine replicas the operator asks for (autoscaler output)."),
        "selector": _str("Label selector of the engine pods (for the scale subresource)."),
        "kvUtilization": _num("Mean KV utilisation of ready replicas (0..1), from heartbeats."),
        "kvPercent": _int("kvUtilization in percent, for printing."),
        "routerEndpoint": _str("In-cluster URL of the router."),
        "lastScaleTime": _str(
            "When the autoscaler last changed the replica count.", format="date-time"
        ),
        "lastDecision": _DECISION,
        "adapters": {
            "type": "array",
            "description": "Each adapter of the spec and its state on the ready replicas.",
            "items": _ADAPTER_STATUS,
        },
        "adaptersReady": _str("Adapters loaded on every ready replica / adapters, e.g. 2/2."),
    },
)

PRINTER_COLUMNS = [
    {"name": "Model", "type": "string", "jsonPath": ".status.model"},
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
    {"name": "Replicas", "type": "integer", "jsonPath": ".status.replicas"},
    {"name": "KV%", "type": "integer", "jsonPath": ".status.kvPercent"},
    {"name": "Adapters", "type": "string", "jsonPath": ".status.adaptersReady"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def openapi_schema() -> dict[str, Any]:
    """The openAPIV3Schema of the custom resource (a fresh copy)."""
    return copy.deepcopy(
        {
            "type": "object",
            "properties": {
                "apiVersion": {"type": "string"},
                "kind": {"type": "string"},
                "metadata": {"type": "object"},
                "spec": SPEC_SCHEMA,
                "status": STATUS_SCHEMA,
            },
            "required": ["spec"],
        }
    )


def crd_manifest() -> dict[str, Any]:
    """The CustomResourceDefinition object."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME, "labels": {"app.kubernetes.io/name": "kvmesh"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": ["kvmesh"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.readyReplicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": copy.deepcopy(PRINTER_COLUMNS),
                }
            ],
        },
    }


def all_cel_rules() -> list[tuple[str, dict[str, str]]]:
    """(JSON path of the schema node, rule) for every CEL rule, for tests and docs."""
    return (
        [("spec", r) for r in SPEC_RULES]
        + [("spec.model", r) for r in MODEL_RULES]
        + [("spec.engine", r) for r in ENGINE_RULES]
        + [("spec.engine.rollout", r) for r in ROLLOUT_RULES]
        + [("spec.autoscaling", r) for r in AUTOSCALING_RULES]
        + [("spec.redis", r) for r in REDIS_RULES]
        + [("spec.router.flowControl", r) for r in FLOW_RULES]
        + [("spec.adapters", r) for r in ADAPTERS_RULES]
        + [("spec.adapters[*].name", r) for r in ADAPTER_NAME_RULES]
        + [("spec.adapters[*].source", r) for r in ADAPTER_SOURCE_RULES]
        + [("spec.engine.loraModules[*].name", r) for r in ADAPTER_NAME_RULES]
        + [("spec.lora", r) for r in LORA_RULES]
        + [("spec.engine.kvOffload.shared.volume", r) for r in KV_SHARED_VOLUME_RULES]
    )
