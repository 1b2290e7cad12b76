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

GROUP = "kvmesh.io"
VERSION = "v1alpha1"
KIND = "ModelDeployment"
PLURAL = "modeldeployments"
SINGULAR = "modeldeployment"
SHORT_NAMES = ["md"]
CRD_NAME = f"{PLURAL}.{GROUP}"
API_VERSION = f"{GROUP}/{VERSION}"

# Engine defaults: the same as `kvmesh serve` (docs/cli.md).
DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_NUM_SEQS = 128
DEFAULT_DRAIN_TIMEOUT = 30
DEFAULT_GRACE_PERIOD = 60
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
    return _obj(desc, {
        "name": _str("Secret name (same namespace).", minLength=1),
        "key": _str("Key inside the Secret.", default=default_key),
    }, required=["name"])


_QUANTITY = {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}

# (CEL rule, message) pairs. Each rule is mirrored in spec.py's Python checks and
# evaluated by the tests with a CEL interpreter against the same examples.
SPEC_RULES: list[dict[str, str]] = [
    {"rule": "!(has(self.replicas) && has(self.autoscaling))",
     "message": "set either spec.replicas or spec.autoscaling, not both"},
]
MODEL_RULES = [
    {"rule": "(has(self.builtin) ? 1 : 0) + (has(self.huggingFace) ? 1 : 0) + (has(self.pvc) ? 1 : 0) == 1",
     "message": "set exactly one model source: builtin, huggingFace or pvc"},
]
ENGINE_RULES = [
    {"rule": "self.drainTimeoutSeconds < self.terminationGracePeriodSeconds",
     "message": "drainTimeoutSeconds must be less than terminationGracePeriodSeconds"},
]
AUTOSCALING_RULES = [
    {"rule": "self.minReplicas <= self.maxReplicas",
     "message": "autoscaling.minReplicas must be <= autoscaling.maxReplicas"},
]
REDIS_RULES = [
    {"rule": "self.mode != 'external' || has(self.url) || has(self.secretRef)",
     "message": "external Redis needs a url or a secretRef"},
]

SPEC_SCHEMA: dict[str, Any] = _obj("Desired state of a served model.", {
    "model": _obj("Where the weights come from. Exactly one source.", {
        "servedModelName": _str("Model name clients ask for (and the block-key identity). "
                                "Default: the builtin name, the Hugging Face repo id, or the PVC path.",
                                maxLength=253),
        "builtin": _str("A model built into the engine image, e.g. smollm2-135m-instruct.", minLength=1),
        "huggingFace": _obj("A Hugging Face repository, downloaded by an init container into a volume.", {
            "repoId": _str("Repository id, e.g. HuggingFaceTB/SmolLM2-135M-Instruct.", minLength=1),
            "revision": _str("Branch, tag or commit.", default="main"),
            "tokenSecretRef": _secret_ref("Secret holding a Hugging Face token (gated models).", "HF_TOKEN"),
            "cacheSize": _str("Size limit of the download volume.", default="50Gi"),
        }, required=["repoId"]),
        "pvc": _obj("A Hugging Face directory on an existing PersistentVolumeClaim (mounted read-only).", {
            "claimName": _str("PersistentVolumeClaim name.", minLength=1),
            "path": _str("Directory inside the volume.", default=""),
        }, required=["claimName"]),
    }, **{"x-kubernetes-validations": MODEL_RULES}),
    "engine": _obj("Engine container settings (flags of `kvmesh serve`).", {
        "image": _str("Engine image; empty means the operator's default."),
        "imagePullPolicy": _str("Image pull policy.", enum=["Always", "IfNotPresent", "Never"],
                                default="IfNotPresent"),
        "extraArgs": {"type": "array", "items": {"type": "string"},
                      "description": "Extra `kvmesh serve` arguments, appended last."},
        "blockSize": _int("Tokens per KV block (--block-size).", default=DEFAULT_BLOCK_SIZE,
                          minimum=1, maximum=1024),
        "maxNumBatchedTokens": _int("Token budget per engine step (--max-num-batched-tokens).",
                                    default=DEFAULT_MAX_NUM_BATCHED_TOKENS, minimum=1),
        "maxNumSeqs": _int("Most requests running at once (--max-num-seqs).",
                           default=DEFAULT_MAX_NUM_SEQS, minimum=1),
        "maxModelLen": _int("Longest prompt + output (--max-model-len); default: the model's.", minimum=1),
        "enablePrefixCaching": _bool("Prefix caching (--enable-prefix-caching).", default=True),
        "enableChunkedPrefill": _bool("Chunked prefill (--enable-chunked-prefill).", default=True),
        "dtype": _str("Weights/activations dtype (--dtype).",
                      enum=["auto", "float32", "bfloat16", "float16"], default="auto"),
        "kvCacheMemory": _str("KV cache size in bytes, e.g. 2GiB (--kv-cache-memory)."),
        "drainTimeoutSeconds": _int("On shutdown, how long in-flight requests may finish (--drain-timeout).",
                                    default=DEFAULT_DRAIN_TIMEOUT, minimum=0),
        "terminationGracePeriodSeconds": _int("Pod grace period; must exceed the drain timeout.",
                                              default=DEFAULT_GRACE_PERIOD, minimum=1),
        "resources": _obj("Container resources, e.g. limits: {nvidia.com/gpu: 1}.", {
            "requests": {"type": "object", "additionalProperties": _QUANTITY},
            "limits": {"type": "object", "additionalProperties": _QUANTITY},
        }),
        "shmSize": _str("Size of the in-memory /dev/shm.", default="1Gi"),
        "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
        "tolerations": {"type": "array", "items": {"type": "object",
                                                   "x-kubernetes-preserve-unknown-fields": True}},
        "heartbeatIntervalSeconds": _num("Sidecar heartbeat interval.", default=1, minimum=0.1),
    }, default={}, **{"x-kubernetes-validations": ENGINE_RULES}),
    "replicas": _int("Fixed number of engine replicas (mutually exclusive with autoscaling).", minimum=0),
    "autoscaling": _obj("Scale engine replicas on KV-cache utilisation.", {
        "minReplicas": _int("Lower bound.", default=1, minimum=1),
        "maxReplicas": _int("Upper bound.", minimum=1),
        "targetKVUtilization": _num("Target mean KV utilisation of ready replicas (0..1].",
                                    default=0.7, exclusiveMinimum=True, minimum=0, maximum=1),
        "tolerance": _num("No change while |utilisation/target - 1| <= tolerance.",
                          default=0.1, minimum=0, maximum=1),
        "scaleUpStabilizationSeconds": _int("Scale up to the lowest recommendation of this window.",
                                            default=0, minimum=0),
        "scaleDownStabilizationSeconds": _int("Scale down to the highest recommendation of this window.",
                                              default=300, minimum=0),
        "maxScaleDownStep": _int("Most replicas removed in one decision.", default=1, minimum=1),
        "intervalSeconds": _num("How often the autoscaler decides.", default=15, minimum=0.1),
    }, required=["maxReplicas"], **{"x-kubernetes-validations": AUTOSCALING_RULES}),
    "router": _obj("The prefix-aware router in front of the engines.", {
        "replicas": _int("Router replicas.", default=1, minimum=0),
        "image": _str("Router image; empty means the operator's default (also used for the sidecar)."),
        "policy": _str("Routing policy (--policy).", enum=["prefix", "least-load", "round-robin", "session"],
                       default="prefix"),
        "weights": _obj("Routing-score weights (--weights).", {
            "prefix": _num("Weight of the prefix match.", default=1.0, minimum=0),
            "kv": _num("Weight of the KV usage.", default=0.5, minimum=0),
            "queue": _num("Weight of the queue share.", default=0.5, minimum=0),
        }, default={}),
        "apiKeySecretRef": _secret_ref("Secret with API keys, one per line.", "api-keys"),
        "serviceType": _str("Router Service type.", enum=["ClusterIP", "NodePort", "LoadBalancer"],
                            default="ClusterIP"),
        "resources": _obj("Router container resources.", {
            "requests": {"type": "object", "additionalProperties": _QUANTITY},
            "limits": {"type": "object", "additionalProperties": _QUANTITY},
        }),
    }, default={}),
    "redis": _obj("The Redis the sidecars write and the router reads.", {
        "mode": _str("managed: the operator runs one; external: use url or secretRef.",
                     enum=["managed", "external"], default="managed"),
        "url": _str("redis:// URL of an external Redis.", pattern=r"^rediss?://"),
        "secretRef": _secret_ref("Secret holding the external Redis URL.", "url"),
        "image": _str("Managed Redis image; empty means the operator's default."),
    }, default={}, **{"x-kubernetes-validations": REDIS_RULES}),
}, required=["model"], **{"x-kubernetes-validations": SPEC_RULES})

_CONDITION = _obj("A condition.", {
    "type": _str("Ready, Progressing or Degraded."),
    "status": _str("True, False or Unknown.", enum=["True", "False", "Unknown"]),
    "reason": _str("CamelCase reason."),
    "message": _str("Human-readable detail."),
    "lastTransitionTime": _str("When the status last changed.", format="date-time"),
    "observedGeneration": _int("Generation this condition reflects."),
}, required=["type", "status"])

_DECISION = _obj("An autoscaling decision.", {
    "time": _str("When it was taken.", format="date-time"),
    "action": _str("scale-up, scale-down, hold or none."),
    "currentReplicas": _int("Replicas before."),
    "desiredReplicas": _int("Replicas after."),
    "recommendation": _int("Raw recommendation before stabilisation and bounds."),
    "kvUtilization": _num("Mean KV utilisation of ready replicas, if known."),
    "reason": _str("Why."),
})

STATUS_SCHEMA: dict[str, Any] = _obj("Observed state.", {
    "observedGeneration": _int("The spec generation last reconciled."),
    "conditions": {"type": "array", "items": _CONDITION,
                   "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    "model": _str("Served model name."),
    "replicas": _int("Engine pods that exist."),
    "readyReplicas": _int("Engine pods that are ready."),
    "desiredReplicas": _int("Engine replicas the operator asks for (autoscaler output)."),
    "selector": _str("Label selector of the engine pods (for the scale subresource)."),
    "kvUtilization": _num("Mean KV utilisation of ready replicas (0..1), from heartbeats."),
    "kvPercent": _int("kvUtilization in percent, for printing."),
    "routerEndpoint": _str("In-cluster URL of the router."),
    "lastScaleTime": _str("When the autoscaler last changed the replica count.", format="date-time"),
    "lastDecision": _DECISION,
})

PRINTER_COLUMNS = [
    {"name": "Model", "type": "string", "jsonPath": ".status.model"},
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
    {"name": "Replicas", "type": "integer", "jsonPath": ".status.replicas"},
    {"name": "KV%", "type": "integer", "jsonPath": ".status.kvPercent"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def openapi_schema() -> dict[str, Any]:
    """The openAPIV3Schema of the custom resource (a fresh copy)."""
    return copy.deepcopy({
        "type": "object",
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": SPEC_SCHEMA,
            "status": STATUS_SCHEMA,
        },
        "required": ["spec"],
    })


def crd_manifest() -> dict[str, Any]:
    """The CustomResourceDefinition object."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME, "labels": {"app.kubernetes.io/name": "kvmesh"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "plural": PLURAL, "singular": SINGULAR,
                      "shortNames": list(SHORT_NAMES), "categories": ["kvmesh"]},
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": openapi_schema()},
                "subresources": {
                    "status": {},
                    "scale": {"specReplicasPath": ".spec.replicas",
                              "statusReplicasPath": ".status.replicas",
                              "labelSelectorPath": ".status.selector"},
                },
                "additionalPrinterColumns": copy.deepcopy(PRINTER_COLUMNS),
            }],
        },
    }


def all_cel_rules() -> list[tuple[str, dict[str, str]]]:
    """(JSON path of the schema node, rule) for every CEL rule, for tests and docs."""
    return ([("spec", r) for r in SPEC_RULES] + [("spec.model", r) for r in MODEL_RULES]
            + [("spec.engine", r) for r in ENGINE_RULES] + [("spec.autoscaling", r) for r in AUTOSCALING_RULES]
            + [("spec.redis", r) for r in REDIS_RULES])
