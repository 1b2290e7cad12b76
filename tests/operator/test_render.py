"""The pure renderer: golden files, Kubernetes schema validity, and the contracts the
pods depend on (flags of docs/cli.md, probes, drain, security, Redis URL from a Secret)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kvmesh.operator import render
from kvmesh.operator import spec as specs
from kvmesh.operator.generate import dump

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"
MD = {
    "apiVersion": "kvmesh.io/v1alpha1",
    "kind": "ModelDeployment",
    "metadata": {"name": "demo", "namespace": "prod", "uid": "0d3b1f0e-uid", "generation": 1},
}

CASES = {
    "builtin-fixed": {"model": {"builtin": "smollm2-135m-instruct"}, "replicas": 2},
    "hf-gpu-autoscaling": {
        "model": {
            "huggingFace": {
                "repoId": "HuggingFaceTB/SmolLM2-135M-Instruct",
                "tokenSecretRef": {"name": "hf"},
            }
        },
        "engine": {
            "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "24Gi"}},
            "maxModelLen": 4096,
            "enablePrefixCaching": False,
            "extraArgs": ["--max-waiting", "256"],
        },
        "autoscaling": {"minReplicas": 2, "maxReplicas": 6},
        "router": {"replicas": 2, "apiKeySecretRef": {"name": "keys"}, "weights": {"prefix": 2}},
    },
    "pvc-external-redis": {
        "model": {
            "pvc": {"claimName": "weights", "path": "llama-3-8b"},
            "servedModelName": "llama3",
        },
        "redis": {"mode": "external", "secretRef": {"name": "shared-redis", "key": "REDIS_URL"}},
        "engine": {"kvCacheMemory": "8GiB", "dtype": "bfloat16", "nodeSelector": {"gpu": "h100"}},
    },
    "hf-shared-cache-pod-template": {
        "model": {
            "huggingFace": {
                "repoId": "Qwen/Qwen2.5-7B-Instruct",
                "revision": "v1",
                "cacheSize": "40Gi",
                "sharedCache": {"enabled": True, "storageClassName": "nfs"},
            }
        },
        "replicas": 3,
        "engine": {
            "resources": {"limits": {"nvidia.com/gpu": 1}},
            "rollout": {"strategy": "Recreate"},
            "probes": {"startup": {"failureThreshold": 360, "periodSeconds": 10}},
            "env": [{"name": "NCCL_DEBUG", "value": "WARN"}],
            "envFrom": [{"configMapRef": {"name": "engine-env"}}],
            "imagePullSecrets": [{"name": "registry"}],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": "gpu", "operator": "In", "values": ["h100", "h200"]}
                                ]
                            }
                        ]
                    }
                }
            },
            "topologySpreadConstraints": [
                {
                    "maxSkew": 1,
                    "topologyKey": "kubernetes.io/hostname",
                    "whenUnsatisfiable": "ScheduleAnyway",
                    "labelSelector": {"matchLabels": {"kvmesh.io/model-deployment": "demo"}},
                }
            ],
            "priorityClassName": "inference",
            "runtimeClassName": "nvidia",
            "tolerations": [
                {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}
            ],
            "volumes": [{"name": "extra", "configMap": {"name": "chat-templates"}}],
            "volumeMounts": [{"name": "extra", "mountPath": "/templates", "readOnly": True}],
            "drainTimeoutSeconds": 60,
            "preStopSleepSeconds": 10,
            "terminationGracePeriodSeconds": 90,
        },
        "router": {"replicas": 3},
    },
    "hf-vllm-lora": {
        "model": {"huggingFace": {"repoId": "Qwen/Qwen2.5-7B-Instruct"}},
        "engine": {
            "kind": "vllm",
            "blockSize": 32,
            "maxModelLen": 8192,
            "maxNumSeqs": 64,
            "gpuMemoryUtilization": 0.85,
            "toolCallParser": "hermes",
            "loraModules": [{"name": "sql", "path": "/models/adapters/sql"}],
            "resources": {"limits": {"nvidia.com/gpu": 1}},
        },
        "lora": {"maxLoras": 2},
    },
    "pvc-adapters": {
        "model": {"pvc": {"claimName": "weights", "path": "qwen"}},
        "adapters": [
            {"name": "sql", "source": {"pvc": {"claimName": "weights", "path": "lora/sql"}}},
            {"name": "chat/v2", "source": {"pvc": {"claimName": "tuned"}}},
            {"name": "local", "source": {"path": "/srv/adapters/local"}},
        ],
        "lora": {"maxLoras": 2, "maxCpuLoras": 4, "maxRank": 64},
    },
    "hf-shared-cache-adapters": {
        "model": {"huggingFace": {"repoId": "Qwen/Qwen2.5-0.5B", "sharedCache": {"enabled": True}}},
        "engine": {"kind": "vllm"},
        "adapters": [
            {
                "name": "sql",
                "source": {
                    "huggingFace": {
                        "repoId": "acme/qwen-sql-lora",
                        "revision": "v1",
                        "tokenSecretRef": {"name": "hf"},
                    }
                },
            }
        ],
    },
    "builtin-kv-offload": {
        "model": {"builtin": "smollm2-135m-instruct"},
        "replicas": 2,
        "engine": {
            "kvOffload": {
                "hostMemory": "8Gi",
                "shared": {"volume": {"persistentVolumeClaim": {"claimName": "kv-store"}}},
            },
            "resources": {"requests": {"memory": "4Gi"}, "limits": {"memory": "6Gi"}},
        },
    },
}


def rendered(case):
    return render.render_children(MD, specs.apply_defaults(CASES[case]))


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case):
    text = dump(
        rendered(case),
        header=f"# Golden: children rendered for tests/operator/test_render.py CASES[{case!r}].\n",
    )
    path = GOLDEN / f"{case}.yaml"
    if os.environ.get("UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), (
        f"rendered children changed; UPDATE_GOLDEN=1 to accept ({path})"
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_child_is_a_valid_kubernetes_object(case):
    for child in rendered(case):
        kubernetes_validate.validate(child, "1.37.0", strict=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_owner_references_and_labels(case):
    for child in rendered(case):
        (ref,) = child["metadata"]["ownerReferences"]
        assert ref == {
            "apiVersion": "kvmesh.io/v1alpha1",
            "kind": "ModelDeployment",
            "name": "demo",
            "uid": "0d3b1f0e-uid",
            "controller": True,
            "blockOwnerDeletion": True,
        }
        assert child["metadata"]["labels"][render.LABEL_MD] == "demo"
        assert child["metadata"]["namespace"] == "prod"


def _wide_case() -> dict:
    """A spec with many values in every list or map the user supplies: an order taken from a set
    or from hash() shows in it with near certainty (one of 8! orders)."""
    import copy

    wide = copy.deepcopy(CASES["hf-shared-cache-pod-template"])
    eng = wide["engine"]
    eng["extraArgs"] = [f"--flag-{i}" for i in range(8)]
    eng["nodeSelector"] = {f"zone-{i}": f"v{i}" for i in range(8)}
    eng["env"] = [{"name": f"VAR_{i}", "value": str(i)} for i in range(8)]
    eng["tolerations"] = [
        {"key": f"k{i}", "operator": "Exists", "effect": "NoSchedule"} for i in range(8)
    ]
    eng["imagePullSecrets"] = [{"name": f"registry-{i}"} for i in range(8)]
    wide["router"]["weights"] = {"prefix": 2, "kv": 0.25, "queue": 0.75}
    return wide


_RENDER_ALL = """
import json, sys
from tests.operator.test_render import CASES, MD, _wide_case
from kvmesh.operator import render, spec as specs
out = {case: render.render_children(MD, specs.apply_defaults(spec), credentials="c1")
       for case, spec in sorted({**CASES, "wide": _wide_case()}.items())}
sys.stdout.write(json.dumps(out))  # no sort_keys: key and list order must match too
"""


def _render_in_process(hash_seed: str) -> str:
    import subprocess
    import sys

    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    out = subprocess.run(
        [sys.executable, "-c", _RENDER_ALL],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_render_is_pure_and_deterministic():
    spec = specs.apply_defaults(CASES["hf-gpu-autoscaling"])
    before = yaml.safe_dump(spec)
    assert render.render_children(MD, spec) == render.render_children(MD, spec)
    assert yaml.safe_dump(spec) == before  # the spec is not modified
    # Across processes with different string-hash seeds (set or hash() order would differ), the
    # output is byte for byte the same, down to key and list order: every operator replica and
    # every restart applies the same objects, and server-side apply sees no change.
    first, *others = [_render_in_process(seed) for seed in ("1", "2", "3")]
    assert all(other == first for other in others)
    import json

    assert set(json.loads(first)) == set(CASES) | {"wide"} and all(json.loads(first).values())
    assert (
        "--flag-7" in first and "VAR_7" in first and "registry-7" in first
    )  # the wide values are rendered


def _cli_flags(section: str) -> set[str]:
    text = (ROOT / "docs/cli.md").read_text()
    body = text.split(f"## `kvmesh {section}`", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"`(--[a-z0-9-]+)", body)) | {
        f"--no-{f[2:]}" for f in re.findall(r"`(--[a-z0-9-]+)", body)
    }


def _flags(args):
    return {a for a in args if a.startswith("--")}


@pytest.mark.parametrize("case", sorted(CASES))
def test_pods_call_only_documented_flags(case):
    spec = specs.apply_defaults(CASES[case])
    engine = render.engine_command(spec)
    if engine[:2] == ["sh", "-c"]:  # the adapter-list wrapper: its argv after $0
        assert engine[3] == "engine"
        engine = engine[4:]
    if render.is_vllm(spec):  # vLLM's flags: those vllm_args renders, and the extra ones
        assert engine[:2] == ["vllm", "serve"]
        extra = set(_flags(spec["engine"].get("extraArgs") or []))
        assert _flags(engine) - extra <= VLLM_FLAGS
    else:
        assert engine[:2] == ["kvmesh", "serve"]
        # The LoRA flags are vLLM's, documented with the engine's LoRA serving.
        assert _flags(engine) <= _cli_flags("serve") | LORA_FLAGS
    sidecar = render.sidecar_args(spec)
    assert sidecar[:2] == ["kvmesh", "sidecar"] and _flags(sidecar) <= _cli_flags("sidecar")
    router = render.router_args(spec, "demo")
    assert router[:2] == ["kvmesh", "router"] and _flags(router) <= _cli_flags("router")
    # The three agree on the block size and model identity.
    bs = str(spec["engine"]["blockSize"])
    for args in (engine, sidecar, router):
        assert args[args.index("--block-size") + 1] == bs
    name = specs.served_model_name(spec)
    assert engine[engine.index("--served-model-name") + 1] == name
    assert (
        sidecar[sidecar.index("--model") + 1] == name
        and router[router.index("--model") + 1] == name
    )


LORA_FLAGS = {
    "--enable-lora",
    "--max-loras",
    "--max-cpu-loras",
    "--max-lora-rank",
    "--lora-modules",
}

# The `vllm serve` flags kvmesh renders (vLLM 0.32; tests/vllm/ runs them for real).
VLLM_FLAGS = {
    "--served-model-name",
    "--host",
    "--port",
    "--block-size",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--enable-prompt-tokens-details",
    "--kv-events-config",
    "--dtype",
    "--max-model-len",
    "--max-num-seqs",
    "--gpu-memory-utilization",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "--enable-lora",
    "--lora-modules",
    "--max-loras",
    "--max-cpu-loras",
    "--max-lora-rank",
    "--shutdown-timeout",
    "--kv-cache-memory-bytes",
    "--max-num-batched-tokens",
    "--no-enable-chunked-prefill",
    "--kv-offloading-size",
    "--kv-offloading-backend",
}


def test_a_vllm_engine_is_rendered_from_the_same_spec():
    dep = next(c for c in rendered("hf-vllm-lora") if c["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    engine, sidecar = pod["containers"]
    assert engine["image"] == render.Images().vllm == "vllm/vllm-openai:v0.32.0"
    args = engine["command"][4:]  # after `sh -c WRAPPER engine`
    assert args[:3] == ["vllm", "serve", "/models/model"]
    events = json.loads(args[args.index("--kv-events-config") + 1])
    assert events["endpoint"] == f"tcp://*:{render.KV_EVENTS_PORT}"
    assert events["replay_endpoint"] == f"tcp://*:{render.KV_REPLAY_PORT}"
    assert args[args.index("--max-loras") + 1] == "2"
    assert args[args.index("--tool-call-parser") + 1] == "hermes"
    # vLLM's own probes; its key in vLLM's variable, and the sidecar reads /v1/models with it.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert engine[probe]["httpGet"]["path"] == "/health"
    assert [e["name"] for e in engine["env"]][-1] == "VLLM_API_KEY"
    assert "KVMESH_ENGINE_API_KEY" in [e["name"] for e in sidecar["env"]]
    assert sidecar["command"][-2:] == ["--engine-format", "vllm"]
    # Drain: the engine sleeps in preStop while the sidecar marks the pod draining, then vLLM
    # finishes its requests for up to drainTimeoutSeconds after SIGTERM.
    assert engine["lifecycle"]["preStop"]["sleep"]["seconds"] > 0
    assert args[args.index("--shutdown-timeout") + 1] == "30"
    # The model is fetched by kvmesh's image (python, huggingface_hub), not vLLM's.
    assert pod["initContainers"][0]["image"] == render.Images().engine
    router = render.router_args(specs.apply_defaults(CASES["hf-vllm-lora"]), "demo")
    assert router[router.index("--engine") + 1] == "vllm"
    assert router[router.index("--tool-call-parser") + 1] == "hermes"


def test_engine_args_reflect_spec():
    spec = specs.apply_defaults(CASES["hf-gpu-autoscaling"])
    args = render.engine_args(spec)
    assert args[args.index("--model") + 1] == "/models/model"
    assert "--no-enable-prefix-caching" in args and "--enable-chunked-prefill" in args
    assert args[args.index("--max-model-len") + 1] == "4096"
    assert args[-2:] == ["--max-waiting", "256"]
    assert (
        render.router_args(spec, "demo")[render.router_args(spec, "demo").index("--weights") + 1]
        == "prefix=2,kv=0.5,queue=0.5"
    )


def test_engine_pod_contract():
    dep = rendered("hf-gpu-autoscaling")[0]
    assert dep["kind"] == "Deployment" and dep["metadata"]["name"] == "demo-engine"
    assert dep["spec"]["replicas"] == 2  # autoscaling starts at minReplicas
    pod = dep["spec"]["template"]["spec"]
    engine, sidecar = pod["containers"]
    assert engine["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert engine["livenessProbe"]["httpGet"]["path"] == "/health"
    assert engine["startupProbe"]["httpGet"]["path"] == "/health"
    drain = int(engine["command"][engine["command"].index("--drain-timeout") + 1])
    assert (
        pod["terminationGracePeriodSeconds"]
        > drain + engine["lifecycle"]["preStop"]["sleep"]["seconds"]
    )
    env = {e["name"]: e for e in sidecar["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    # Managed Redis requires a password: the URL (with it) is in the generated Secret.
    assert env["KVMESH_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": "demo-redis-auth",
        "key": "url",
    }
    engine_env = {e["name"]: e for e in engine["env"]}
    assert engine_env["KVMESH_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "demo-engine-api-key",
        "key": "api-key",
    }
    assert pod["securityContext"]["runAsNonRoot"] is True
    for c in pod["containers"] + pod["initContainers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 1
    init = pod["initContainers"][0]
    assert "snapshot_download" in init["command"][-1]
    assert {e["name"]: e for e in init["env"]}["HF_TOKEN"]["valueFrom"]["secretKeyRef"][
        "name"
    ] == "hf"


def test_external_redis_secret_and_no_managed_redis():
    children = rendered("pvc-external-redis")
    kinds = {(c["kind"], c["metadata"]["name"]) for c in children}
    assert ("Deployment", "demo-redis") not in kinds and ("Secret", "demo-redis-url") not in kinds
    engine = children[0]["spec"]["template"]["spec"]["containers"][1]
    ref = {e["name"]: e for e in engine["env"]}["KVMESH_REDIS_URL"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "shared-redis", "key": "REDIS_URL"}
    pvc = next(
        v for v in children[0]["spec"]["template"]["spec"]["volumes"] if v["name"] == "models"
    )
    assert pvc["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}


def test_network_policy_admits_only_router_and_scrapers():
    netpol = next(c for c in rendered("builtin-fixed") if c["kind"] == "NetworkPolicy")
    assert netpol["spec"]["podSelector"]["matchLabels"] == render.selector("demo", "engine")
    sources = [f for rule in netpol["spec"]["ingress"] for f in rule["from"]]
    assert {"podSelector": {"matchLabels": render.selector("demo", "router")}} in sources
    assert all(
        (
            "podSelector" in s
            and s["podSelector"]["matchLabels"]
            in (render.selector("demo", "router"), {render.LABEL_SCRAPER: "true"})
        )
        or s.get("namespaceSelector") == {"matchLabels": {render.LABEL_SCRAPER: "true"}}
        for s in sources
    )


def test_headless_engine_service():
    svc = next(
        c
        for c in rendered("builtin-fixed")
        if c["kind"] == "Service" and c["metadata"]["name"] == "demo-engine"
    )
    assert svc["spec"]["clusterIP"] == "None"


def _kind(children, kind, name=None):
    return [
        c for c in children if c["kind"] == kind and (name is None or c["metadata"]["name"] == name)
    ]


def test_redis_secret_is_rendered_as_data_for_server_side_apply():
    """stringData is write-only: under server-side apply the API server folds it into data,
    so the applied field never matches and the operator fights itself. Render data."""
    import base64

    spec = specs.apply_defaults({**CASES["builtin-fixed"], "redis": {"requirePassword": False}})
    (secret,) = _kind(render.render_children(MD, spec), "Secret")
    assert "stringData" not in secret
    assert base64.b64decode(secret["data"]["url"]).decode() == "redis://demo-redis.prod.svc:6379/0"
    redis = _kind(render.render_children(MD, spec), "Deployment", "demo-redis")[0]
    assert "--requirepass" not in redis["spec"]["template"]["spec"]["containers"][0]["args"]


def test_generated_credentials_wire_engines_router_and_redis():
    """Engines take a generated API key that only the router holds; the managed Redis takes
    a generated password that only this deployment's pods (and the operator) know."""
    import base64

    spec = specs.apply_defaults(CASES["builtin-fixed"])
    assert render.generated_secret_names("demo", spec) == ["demo-engine-api-key", "demo-redis-auth"]
    auth = render.generated_secret(MD, spec, "demo-redis-auth", "tok3n")
    data = {k: base64.b64decode(v).decode() for k, v in auth["data"].items()}
    assert data == {"password": "tok3n", "url": "redis://:tok3n@demo-redis.prod.svc:6379/0"}
    assert auth["metadata"]["ownerReferences"][0]["uid"] == MD["metadata"]["uid"]
    children = render.render_children(MD, spec, credentials="c0ffee")
    assert not _kind(children, "Secret")  # generated, never rendered (render is pure)
    redis = _kind(children, "Deployment", "demo-redis")[0]["spec"]["template"]
    args = redis["spec"]["containers"][0]["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert redis["spec"]["containers"][0]["env"][0]["valueFrom"]["secretKeyRef"] == {
        "name": "demo-redis-auth",
        "key": "password",
    }
    router = _kind(children, "Deployment", "demo-router")[0]["spec"]["template"]
    env = {e["name"]: e for e in router["spec"]["containers"][0]["env"]}
    assert env["KVMESH_UPSTREAM_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "demo-engine-api-key",
        "key": "api-key",
    }
    # A replaced credential rolls every pod that holds it.
    for dep in ("demo-engine", "demo-router", "demo-redis"):
        tmpl = _kind(children, "Deployment", dep)[0]["spec"]["template"]
        assert tmpl["metadata"]["annotations"]["kvmesh.io/credentials"] == "c0ffee"
    (netpol,) = _kind(children, "NetworkPolicy", "demo-redis")
    sources = netpol["spec"]["ingress"][0]["from"]
    assert {"podSelector": {"matchLabels": {render.LABEL_MD: "demo"}}} in sources
    assert all(s.get("podSelector") for s in sources)  # no source admits whole namespaces
    off = specs.apply_defaults(
        {
            **CASES["builtin-fixed"],
            "engine": {"requireApiKey": False},
            "redis": {"requirePassword": False},
        }
    )
    assert render.generated_secret_names("demo", off) == []
    engine = _kind(render.render_children(MD, off), "Deployment", "demo-engine")[0]
    assert "KVMESH_API_KEY" not in {
        e["name"] for e in engine["spec"]["template"]["spec"]["containers"][0]["env"]
    }


def test_shared_model_cache_claim_job_and_read_only_mounts():
    children = rendered("hf-shared-cache-pod-template")
    (claim,) = _kind(children, "PersistentVolumeClaim")
    assert claim["metadata"]["name"] == "demo-model-cache"
    assert claim["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": "40Gi"}},
        "storageClassName": "nfs",
    }
    (job,) = _kind(children, "Job")
    fetch = job["spec"]["template"]["spec"]["containers"][0]
    model_dir = render.model_dir(specs.apply_defaults(CASES["hf-shared-cache-pod-template"]))
    assert model_dir.startswith("/models/") and model_dir != "/models/model"
    assert (
        f"local_dir={model_dir!r}" in fetch["command"][-1]
        and render.MODEL_READY_MARKER in fetch["command"][-1]
    )
    pod = _kind(children, "Deployment", "demo-engine")[0]["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["initContainers"]] == ["wait-for-model"]  # no per-pod download
    assert model_dir in pod["initContainers"][0]["command"][-1]
    models = next(v for v in pod["volumes"] if v["name"] == "models")
    assert models["persistentVolumeClaim"] == {"claimName": "demo-model-cache", "readOnly": True}
    engine = pod["containers"][0]
    assert engine["command"][engine["command"].index("--model") + 1] == model_dir
    # Another revision is another directory and another Job; the same spec is the same Job.
    other = dict(CASES["hf-shared-cache-pod-template"])
    other["model"] = {"huggingFace": {**other["model"]["huggingFace"], "revision": "v2"}}
    other_children = render.render_children(MD, specs.apply_defaults(other))
    assert _kind(other_children, "Job")[0]["metadata"]["name"] != job["metadata"]["name"]
    assert render.model_dir(specs.apply_defaults(other)) != model_dir
    assert (
        _kind(rendered("hf-shared-cache-pod-template"), "Job")[0]["metadata"]["name"]
        == job["metadata"]["name"]
    )


def test_pod_template_passthrough_rollout_and_probes():
    children = rendered("hf-shared-cache-pod-template")
    dep = _kind(children, "Deployment", "demo-engine")[0]
    case = CASES["hf-shared-cache-pod-template"]["engine"]
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    pod = dep["spec"]["template"]["spec"]
    for key in (
        "affinity",
        "topologySpreadConstraints",
        "priorityClassName",
        "runtimeClassName",
        "imagePullSecrets",
    ):
        assert pod[key] == case[key], key
    assert case["tolerations"][0] in pod["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert {"name": "extra", "configMap": {"name": "chat-templates"}} in pod["volumes"]
    engine = pod["containers"][0]
    assert {"name": "NCCL_DEBUG", "value": "WARN"} in engine["env"] and engine["envFrom"] == case[
        "envFrom"
    ]
    assert case["volumeMounts"][0] in engine["volumeMounts"]
    assert (
        engine["startupProbe"]["failureThreshold"] == 360
        and engine["startupProbe"]["periodSeconds"] == 10
    )
    assert engine["readinessProbe"]["periodSeconds"] == 2  # untouched probes keep their defaults
    assert engine["lifecycle"]["preStop"]["sleep"]["seconds"] == 10
    assert pod["terminationGracePeriodSeconds"] == 90
    router = _kind(children, "Deployment", "demo-router")[0]["spec"]["template"]["spec"]
    assert router["imagePullSecrets"] == case["imagePullSecrets"]
    assert router["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"] > 0
    default = _kind(rendered("builtin-fixed"), "Deployment", "demo-engine")[0]
    assert default["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }


def test_pod_disruption_budgets():
    pdbs = {
        p["metadata"]["name"]: p
        for p in _kind(rendered("hf-shared-cache-pod-template"), "PodDisruptionBudget")
    }
    assert set(pdbs) == {"demo-engine", "demo-router"}
    assert pdbs["demo-engine"]["spec"] == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": render.selector("demo", "engine")},
    }
    # A single router gets none: a budget of one pod with maxUnavailable 1 protects nothing.
    assert [
        p["metadata"]["name"] for p in _kind(rendered("builtin-fixed"), "PodDisruptionBudget")
    ] == ["demo-engine"]
    off = specs.apply_defaults(
        {**CASES["builtin-fixed"], "engine": {"podDisruptionBudget": {"enabled": False}}}
    )
    assert _kind(render.render_children(MD, off), "PodDisruptionBudget") == []


def test_engine_replicas_follow_spec_replicas_within_bounds():
    auto = {"model": {"builtin": "m"}, "autoscaling": {"minReplicas": 2, "maxReplicas": 5}}
    assert render.engine_replicas(specs.apply_defaults({**auto, "replicas": 4})) == 4
    assert render.engine_replicas(specs.apply_defaults({**auto, "replicas": 9})) == 5
    assert render.engine_replicas(specs.apply_defaults(auto)) == 2  # default 1, raised to min
    zero = {
        "model": {"builtin": "m"},
        "autoscaling": {"minReplicas": 0, "maxReplicas": 2},
        "replicas": 0,
    }
    assert render.engine_replicas(specs.apply_defaults(zero)) == 0
    assert (
        render.engine_replicas(specs.apply_defaults({"model": {"builtin": "m"}, "replicas": 7}))
        == 7
    )


def test_token_budget_is_rendered_only_when_set():
    """Unset, the engine picks its own per device (2048 on a GPU, 512 on the CPU: engine/config.py)."""
    args = render.engine_args(specs.apply_defaults({"model": {"builtin": "x"}}))
    assert "--max-num-batched-tokens" not in args
    args = render.engine_args(
        specs.apply_defaults({"model": {"builtin": "x"}, "engine": {"maxNumBatchedTokens": 4096}})
    )
    i = args.index("--max-num-batched-tokens")
    assert args[i + 1] == "4096"


def test_the_router_renders_tools_as_the_engines_tool_call_parser_does():
    spec = specs.apply_defaults(CASES["hf-gpu-autoscaling"])
    assert "--tool-call-parser" not in render.router_args(
        spec, "demo"
    )  # the router's default: hermes
    spec["engine"]["extraArgs"] = ["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"]
    args = render.router_args(spec, "demo")
    assert args[args.index("--tool-call-parser") + 1] == "llama3_json"
    assert _flags(args) <= _cli_flags("router")
    spec["engine"]["extraArgs"] = ["--tool-call-parser=hermes"]
    args = render.router_args(spec, "demo")
    assert args[args.index("--tool-call-parser") + 1] == "hermes"


def test_the_router_resumes_as_the_spec_says():
    spec = specs.apply_defaults(CASES["hf-gpu-autoscaling"])
    args = render.router_args(spec, "demo")
    assert (
        args[args.index("--max-resumes") + 1] == "2"
        and args[args.index("--resume-timeout") + 1] == "60"
    )
    spec["router"].update(maxResumes=0, resumeTimeoutSeconds=2.5)
    args = render.router_args(spec, "demo")
    assert (
        args[args.index("--max-resumes") + 1] == "0"
        and args[args.index("--resume-timeout") + 1] == "2.5"
    )


def test_the_router_queues_by_band_and_tenant_as_spec_router_flow_control_says():
    spec = specs.apply_defaults(CASES["hf-gpu-autoscaling"])
    assert not any(a.startswith("--flow") for a in render.router_args(spec, "demo"))  # off
    spec = specs.apply_defaults(
        {
            **CASES["hf-gpu-autoscaling"],
            "router": {
                "flowControl": {
                    "enabled": True,
                    "bands": [
                        {"name": "gold", "priority": 9, "weight": 2, "maxQueued": 50},
                        {"name": "rest", "priority": 0},
                    ],
                    "defaultBand": "rest",
                    "deadlineSeconds": 12.5,
                }
            },
        }
    )
    args = render.router_args(spec, "demo")
    assert _flags(args) <= _cli_flags("router")
    tail = args[args.index("--flow-control") :]
    assert tail[:5] == [
        "--flow-control",
        "--flow-band",
        "gold:9:2:50",
        "--flow-band",
        "rest:0:1:256",
    ]
    assert args[args.index("--flow-default-band") + 1] == "rest"
    assert args[args.index("--flow-deadline") + 1] == "12.5"
    assert args[args.index("--flow-queue-threshold") + 1] == "5"
    # what the router makes of them
    import argparse

    from kvmesh.router import cli

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    flow = cli.flow_settings(p.parse_args(args[2:]))
    assert flow.enabled and [b.name for b in flow.ordered] == ["gold", "rest"]
    assert flow.band("gold").weight == 2 and flow.default_deadline == 12.5
