"""The CRD: one schema, valid for Kubernetes, generated files up to date, CEL rules
evaluated by a real CEL interpreter and mirrored by the operator's own validation."""

from __future__ import annotations

import copy
from pathlib import Path

import celpy
import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvmesh.operator import crd, generate, manifests
from kvmesh.operator import spec as specs

ROOT = Path(__file__).resolve().parents[2]
K8S_VERSION = "1.37.0"


def strip_x(schema):
    """OpenAPI v3 (Kubernetes flavour) -> JSON Schema draft 4 (ignore x-kubernetes-*)."""
    if isinstance(schema, dict):
        return {k: strip_x(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if isinstance(schema, list):
        return [strip_x(v) for v in schema]
    return schema


def validate_instance(obj):
    jsonschema.Draft4Validator(strip_x(crd.openapi_schema())).validate(obj)


def cel_errors(spec):
    """Evaluate every x-kubernetes-validations rule of the schema where its node exists."""
    env = celpy.Environment()
    errors = []

    def walk(schema, value):
        for rule in schema.get("x-kubernetes-validations", []):
            prog = env.program(env.compile(rule["rule"]))
            if not bool(prog.evaluate({"self": celpy.json_to_cel(value)})):
                errors.append(rule["message"])
        if isinstance(value, dict):
            for key, sub in (schema.get("properties") or {}).items():
                if key in value:
                    walk(sub, value[key])
        if isinstance(value, list) and isinstance(schema.get("items"), dict):
            for item in value:
                walk(schema["items"], item)

    walk(crd.SPEC_SCHEMA, spec)
    return errors


def test_crd_is_a_valid_kubernetes_object():
    kubernetes_validate.validate(crd.crd_manifest(), K8S_VERSION, strict=True)


def test_crd_shape():
    version = crd.crd_manifest()["spec"]["versions"][0]
    assert crd.crd_manifest()["spec"]["names"]["shortNames"] == ["md"]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.readyReplicas",
        "labelSelectorPath": ".status.selector",
    }
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Model",
        "Ready",
        "Replicas",
        "KV%",
        "Adapters",
        "Age",
    ]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    for field in (
        "observedGeneration",
        "conditions",
        "replicas",
        "readyReplicas",
        "selector",
        "kvUtilization",
        "routerEndpoint",
        "lastScaleTime",
        "lastDecision",
    ):
        assert field in status


def test_generated_files_are_up_to_date():
    stale = [
        p for p, text in generate.outputs(ROOT).items() if not p.exists() or p.read_text() != text
    ]
    assert not stale, "run: python -m kvmesh.operator.generate"
    assert generate.main(["--root", str(ROOT), "--check"]) == 0
    assert yaml.safe_load((ROOT / "manifests/crd.yaml").read_text()) == crd.crd_manifest()
    assert (ROOT / "manifests/crd.yaml").read_text() == (
        ROOT / "charts/kvmesh/crds/modeldeployments.kvmesh.io.yaml"
    ).read_text()


def test_engine_defaults_match_kvmesh_serve():
    d = specs.apply_defaults({"model": {"builtin": "x"}})
    assert d["engine"]["blockSize"] == 16
    assert (
        "maxNumBatchedTokens" not in d["engine"] and d["engine"]["maxNumSeqs"] == 128
    )  # the engine's, per device
    assert (
        d["engine"]["enablePrefixCaching"] is True and d["engine"]["enableChunkedPrefill"] is True
    )
    assert d["engine"]["dtype"] == "auto" and d["engine"]["drainTimeoutSeconds"] == 30
    assert d["router"] == {
        "replicas": 1,
        "policy": "prefix",
        "weights": {"prefix": 1.0, "kv": 0.5, "queue": 0.5},
        "maxResumes": 2,
        "resumeTimeoutSeconds": 60,
        "serviceType": "ClusterIP",
        "podDisruptionBudget": {"enabled": True, "maxUnavailable": 1},
        "flowControl": d["router"]["flowControl"],
    }
    from kvmesh.router.config import RouterConfig  # the router's own defaults
    from kvmesh.router.flow import FlowSettings

    flow, router_flow = d["router"]["flowControl"], FlowSettings()
    assert flow["enabled"] is False and flow["defaultBand"] == router_flow.default_band
    assert [(b["name"], b["priority"], b["weight"], b["maxQueued"]) for b in flow["bands"]] == [
        (b.name, b.priority, b.weight, b.max_queued) for b in router_flow.bands
    ]
    assert (flow["maxQueued"], flow["kvThreshold"], flow["queueThreshold"]) == (
        router_flow.max_queued,
        router_flow.kv_threshold,
        router_flow.queue_threshold,
    )
    assert (flow["podMaxInflight"], flow["maxTenants"]) == (
        router_flow.pod_max_inflight,
        router_flow.max_tenants,
    )

    assert (d["router"]["maxResumes"], d["router"]["resumeTimeoutSeconds"]) == (
        RouterConfig.max_resumes,
        RouterConfig.resume_timeout,
    )
    assert d["redis"] == {"mode": "managed", "requirePassword": True}
    a = specs.apply_defaults({"model": {"builtin": "x"}, "autoscaling": {"maxReplicas": 3}})[
        "autoscaling"
    ]
    assert a["minReplicas"] == 1 and a["targetKVUtilization"] == 0.7 and a["maxScaleDownStep"] == 1
    # The docs table says the same.
    cli = (ROOT / "docs/cli.md").read_text()
    assert "| `--block-size N` | 16 |" in cli
    assert (
        "| `--max-num-batched-tokens N` | none | token budget per engine step (default: 2048; 512 for `serve` on the CPU"
        in cli
    )
    assert "| `--max-num-seqs N` | 128 |" in cli and "| `--drain-timeout SECONDS` | 30 |" in cli


def _ad(name, path):
    return {"name": name, "source": {"path": path}}


def _lora_spec(**kw):
    return {"model": {"builtin": "m"}, **kw}


VALID = [
    {"model": {"builtin": "smollm2-135m-instruct"}},
    _lora_spec(lora={}),
    _lora_spec(
        adapters=[
            _ad("sql", "/a/sql"),
            _ad("org/chat.v2", "/a/chat"),
            {"name": "p", "source": {"pvc": {"claimName": "c", "path": "x/y"}}},
        ],
        lora={"maxLoras": 2, "maxCpuLoras": 2, "maxRank": 64},
        engine={"kind": "vllm", "loraModules": [{"name": "old", "path": "/a/old"}]},
    ),
    {
        "model": {"huggingFace": {"repoId": "o/m", "sharedCache": {"enabled": True}}},
        "adapters": [{"name": "a", "source": {"huggingFace": {"repoId": "o/a"}}}],
    },
    {"model": {"builtin": "m"}, "router": {"flowControl": {"enabled": True}}},
    {
        "model": {"builtin": "m"},
        "router": {
            "flowControl": {
                "enabled": True,
                "bands": [
                    {"name": "gold", "priority": 9, "weight": 2},
                    {"name": "rest", "priority": 0},
                ],
                "defaultBand": "rest",
                "deadlineSeconds": 30,
            }
        },
    },
    {"model": {"builtin": "m"}, "engine": {"rollout": {"maxSurge": "25%", "maxUnavailable": 0}}},
    {
        "model": {
            "huggingFace": {
                "repoId": "HuggingFaceTB/SmolLM2-135M-Instruct",
                "tokenSecretRef": {"name": "hf"},
            }
        },
        "replicas": 3,
    },
    {
        "model": {"pvc": {"claimName": "models", "path": "llama"}},
        "autoscaling": {"minReplicas": 2, "maxReplicas": 2},
    },
    {"model": {"builtin": "m"}, "redis": {"mode": "external", "url": "redis://r:6379/0"}},
    {"model": {"builtin": "m"}, "redis": {"mode": "external", "secretRef": {"name": "redis"}}},
    {
        "model": {"builtin": "m"},
        "engine": {"resources": {"limits": {"nvidia.com/gpu": 1, "memory": "16Gi"}}},
    },
    {
        "model": {"builtin": "m"},
        "engine": {
            "kvOffload": {
                "hostMemory": "8Gi",
                "shared": {"volume": {"hostPath": {"path": "/mnt/kv"}}, "size": "20Gi"},
            },
            "resources": {"limits": {"memory": "16Gi"}},
        },
    },
    {"model": {"builtin": "m"}, "engine": {"kind": "vllm", "kvOffload": {"hostMemory": "512Mi"}}},
]

INVALID = [  # (spec, expected message fragment, caught by CEL?)
    (
        {
            "model": {"builtin": "m"},
            "redis": {"mode": "external", "url": "redis://:hunter2@r:6379/0"},
        },
        "must not carry credentials",
        True,
    ),
    (
        {
            "model": {"builtin": "m"},
            "engine": {"drainTimeoutSeconds": 50, "preStopSleepSeconds": 10},
        },
        "drainTimeoutSeconds + preStopSleepSeconds must be less",
        True,
    ),
    (
        {"model": {"builtin": "m"}, "autoscaling": {"minReplicas": 4, "maxReplicas": 3}},
        "minReplicas must be",
        True,
    ),
    ({"model": {"builtin": "m"}, "redis": {"mode": "external"}}, "external Redis needs", True),
    (
        {
            "model": {"builtin": "m"},
            "engine": {"drainTimeoutSeconds": 60, "terminationGracePeriodSeconds": 60},
        },
        "drainTimeoutSeconds + preStopSleepSeconds must be less",
        True,
    ),
    ({"model": {"builtin": "m", "pvc": {"claimName": "x"}}}, "exactly one model source", True),
    (
        {"model": {"builtin": "m"}, "engine": {"rollout": {"maxSurge": "ten"}}},
        "percentage such as 25%",
        True,
    ),
    (
        {"model": {"builtin": "m"}, "engine": {"rollout": {"maxSurge": "0%", "maxUnavailable": 0}}},
        "cannot both be 0",
        True,
    ),
    (
        {"model": {"builtin": "m"}, "router": {"podDisruptionBudget": {"maxUnavailable": -1}}},
        "non-negative integer",
        True,
    ),
    ({"model": {}}, "exactly one model source", True),
    (
        {
            "model": {"builtin": "m"},
            "router": {
                "flowControl": {
                    "bands": [{"name": "a", "priority": 1}, {"name": "a", "priority": 2}],
                    "defaultBand": "a",
                }
            },
        },
        "band names must be unique",
        True,
    ),
    (
        {
            "model": {"builtin": "m"},
            "router": {
                "flowControl": {
                    "bands": [{"name": "a", "priority": 1}, {"name": "b", "priority": 1}],
                    "defaultBand": "a",
                }
            },
        },
        "band priorities must be unique",
        True,
    ),
    (
        {"model": {"builtin": "m"}, "router": {"flowControl": {"defaultBand": "gold"}}},
        "defaultBand must name one of the bands",
        True,
    ),
    (
        {"model": {"builtin": "m"}, "router": {"flowControl": {"bands": [{"name": "Gold"}]}}},
        "does not match",
        False,
    ),
    ({"model": {"builtin": "m"}, "engine": {"blockSize": 0}}, "less than the minimum", False),
    ({"model": {"builtin": "m"}, "router": {"policy": "random"}}, "is not one of", False),
    (
        {
            "model": {"builtin": "m"},
            "engine": {
                "resources": {"requests": {"nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 2}}
            },
        },
        "requests must equal limits",
        False,
    ),
    ({"model": {"pvc": {"claimName": "x", "path": "../etc"}}}, "inside the volume", False),
    (_lora_spec(adapters=[_ad("a", "/a"), _ad("a", "/b")]), "names must be unique", True),
    (_lora_spec(adapters=[_ad("a b", "/a")]), "no spaces, no '='", True),
    (_lora_spec(adapters=[_ad("a=b", "/a")]), "no spaces, no '='", True),
    (_lora_spec(adapters=[_ad("-a", "/a")]), "starting and ending with a letter", True),
    (
        _lora_spec(adapters=[{"name": "a", "source": {"path": "/a", "pvc": {"claimName": "c"}}}]),
        "exactly one adapter source",
        True,
    ),
    (_lora_spec(adapters=[{"name": "a", "source": {}}]), "exactly one adapter source", True),
    (_lora_spec(lora={"maxLoras": 4, "maxCpuLoras": 2}), "maxCpuLoras must be >=", True),
    (_lora_spec(lora={"maxRank": 12}), "is not one of", False),
    (_lora_spec(lora={"maxLoras": 0}), "less than the minimum", False),
    (_lora_spec(adapters=[_ad("m", "/a")]), "the model's served name", False),
    (
        _lora_spec(
            adapters=[_ad("a", "/a")], engine={"loraModules": [{"name": "a", "path": "/b"}]}
        ),
        "unique across spec.adapters and engine.loraModules",
        False,
    ),
    (
        _lora_spec(adapters=[{"name": "a", "source": {"huggingFace": {"repoId": "o/a"}}}]),
        "needs model.huggingFace.sharedCache.enabled",
        False,
    ),
    (
        _lora_spec(adapters=[{"name": "a", "source": {"pvc": {"claimName": "c", "path": "../x"}}}]),
        "must stay inside the volume",
        False,
    ),
    (
        {
            "model": {"builtin": "m"},
            "engine": {
                "kvOffload": {
                    "shared": {
                        "volume": {"emptyDir": {}, "persistentVolumeClaim": {"claimName": "c"}}
                    }
                }
            },
        },
        "set exactly one volume source",
        True,
    ),
    (
        {"model": {"builtin": "m"}, "engine": {"kvOffload": {"hostMemory": "8 GiB"}}},
        "does not match",
        False,
    ),
    (
        {
            "model": {"builtin": "m"},
            "engine": {"kvOffload": {"shared": {"volume": {"hostPath": {"path": "kv"}}}}},
        },
        "does not match '^/'",
        False,
    ),
]


@pytest.mark.parametrize("spec", VALID)
def test_valid_specs(spec):
    d = specs.apply_defaults(spec)
    validate_instance(
        {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": "x"}, "spec": d}
    )
    assert cel_errors(d) == []
    assert specs.validate("x", d) == []


@pytest.mark.parametrize("spec,fragment,by_cel", INVALID)
def test_invalid_specs(spec, fragment, by_cel):
    d = specs.apply_defaults(spec)
    errors = specs.validate("x", d)
    assert any(fragment in e for e in errors), errors
    if by_cel:  # the API server rejects it at admission with the same message
        assert any(fragment in e for e in cel_errors(d))


def test_cel_rules_and_python_mirrors_agree_on_many_specs():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=150, deadline=None)
    @given(
        st.booleans(),
        st.booleans(),
        st.integers(1, 5),
        st.integers(1, 5),
        st.sampled_from(["managed", "external"]),
        st.booleans(),
        st.integers(0, 90),
        st.integers(1, 90),
        st.sets(st.sampled_from(["builtin", "pvc"])),
    )
    def check(has_replicas, has_auto, lo, hi, mode, has_url, drain, grace, sources):
        spec = {
            "model": {k: ("m" if k == "builtin" else {"claimName": "c"}) for k in sources},
            "engine": {"drainTimeoutSeconds": drain, "terminationGracePeriodSeconds": grace},
            "redis": {"mode": mode, **({"url": "redis://x"} if has_url else {})},
        }
        if has_replicas:
            spec["replicas"] = 1
        if has_auto:
            spec["autoscaling"] = {"minReplicas": lo, "maxReplicas": hi}
        d = specs.apply_defaults(spec)
        assert sorted(cel_errors(d)) == sorted(specs._rule_errors(d))

    check()


def _nodes(schema, path="spec"):
    yield path, schema
    for key, sub in (schema.get("properties") or {}).items():
        yield from _nodes(sub, f"{path}.{key}")


def test_every_schema_default_satisfies_its_own_rules():
    """What the API server checks when the CRD is created: each default, exactly as written
    (nested defaults not applied), must pass the CEL rules of its node. `engine: {}` with a
    rule that read a key without has() made a real API server reject the whole CRD."""
    env = celpy.Environment()
    checked = 0
    for path, node in _nodes(crd.SPEC_SCHEMA):
        if "default" not in node:
            continue
        for rule in node.get("x-kubernetes-validations", []):
            prog = env.program(env.compile(rule["rule"]))
            try:
                ok = bool(prog.evaluate({"self": celpy.json_to_cel(node["default"])}))
            except celpy.CELEvalError as exc:
                raise AssertionError(
                    f"{path}: rule {rule['rule']!r} fails on the default: {exc}"
                ) from exc
            assert ok, f"{path}: the default {node['default']!r} breaks {rule['message']!r}"
            checked += 1
    assert checked >= 3  # engine, redis, and at least one more node carry rules and defaults


def test_spec_replicas_is_always_there_for_the_scale_subresource():
    """/scale reads .spec.replicas: without a default, GET .../scale answered 500."""
    assert specs.apply_defaults({"model": {"builtin": "m"}})["replicas"] == 1
    assert (
        specs.apply_defaults({"model": {"builtin": "m"}, "autoscaling": {"maxReplicas": 3}})[
            "replicas"
        ]
        == 1
    )


def test_name_too_long_is_reported():
    d = specs.apply_defaults({"model": {"builtin": "m"}})
    assert any("metadata.name" in e for e in specs.validate("x" * 60, d))


def test_example_modeldeployment_is_valid():
    ex = manifests.example_modeldeployment()
    validate_instance(ex)
    assert specs.validate(ex["metadata"]["name"], specs.apply_defaults(ex["spec"])) == []
    assert yaml.safe_load((ROOT / "manifests/example-modeldeployment.yaml").read_text()) == ex


def test_schema_rejects_unknown_shapes():
    with pytest.raises(jsonschema.ValidationError):
        validate_instance({"spec": {"model": {"builtin": "m"}, "replicas": -1}})
    with pytest.raises(jsonschema.ValidationError):
        validate_instance(
            {
                "spec": {
                    "model": {"builtin": "m"},
                    "autoscaling": {"maxReplicas": 2, "targetKVUtilization": 0},
                }
            }
        )
    bad = copy.deepcopy(next(v for v in VALID if "huggingFace" in v["model"]))
    del bad["model"]["huggingFace"]["repoId"]
    with pytest.raises(jsonschema.ValidationError):
        validate_instance({"spec": bad})
