"""Rendering the KV tiers (spec.engine.kvOffload): the engine flags of both kinds, the shared
volume and its mount for each volume kind, the host tier's memory added to the container's
request and limit, a changed kvOffload rolling the pods, and bad input refused naming the field."""

from __future__ import annotations

from fractions import Fraction

import kubernetes_validate
import pytest

from kvmesh.operator import kv_offload, render
from kvmesh.operator import spec as specs
from tests.operator.test_render import MD

SHARED_DIR = "/var/lib/kvmesh/kv-shared"


def spec_of(kv, **engine):
    return specs.apply_defaults(
        {"model": {"builtin": "smollm2-135m-instruct"}, "engine": {"kvOffload": kv, **engine}}
    )


def deployment(spec):
    return render.render_engine_deployment(MD, spec, render.Images())


def engine_container(spec):
    return deployment(spec)["spec"]["template"]["spec"]["containers"][0]


def flag(argv, name):
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize(
    ("quantity", "gib"),
    [("8Gi", "8"), ("512Mi", "0.5"), ("1536Mi", "1.5"), ("1Ti", "1024"), ("1G", "0.931323")],
)
def test_host_memory_is_the_offloading_size_in_gib(quantity, gib):
    argv = engine_container(spec_of({"hostMemory": quantity}))["command"]
    assert flag(argv, "--kv-offloading-size") == gib
    assert "--kv-offloading-backend" not in argv  # kvmesh's engine: native is its only backend
    assert "--kv-shared-dir" not in argv


def test_quantities():
    assert kv_offload.quantity_bytes("8Gi") == 8 * 2**30
    assert kv_offload.quantity_bytes("20G") == 20 * 10**9
    assert kv_offload.quantity_bytes("1e9") == 10**9
    assert kv_offload.quantity_bytes(4096) == 4096
    assert kv_offload.quantity_bytes("100m") == Fraction(1, 10)
    for bad in ("8GB", "x", "", "-1Gi", "1e", True):
        with pytest.raises(ValueError):
            kv_offload.quantity_bytes(bad)


def test_without_kv_offload_nothing_changes():
    plain = specs.apply_defaults({"model": {"builtin": "smollm2-135m-instruct"}})
    engine = engine_container(plain)
    assert not [a for a in engine["command"] if a.startswith("--kv-offloading")]
    assert not [a for a in engine["command"] if a.startswith("--kv-shared")]
    assert all(
        v["name"] != "kv-shared" for v in deployment(plain)["spec"]["template"]["spec"]["volumes"]
    )
    with_resources = specs.apply_defaults(
        {"model": {"builtin": "m"}, "engine": {"resources": {"limits": {"memory": "4Gi"}}}}
    )
    assert engine_container(with_resources)["resources"] == {"limits": {"memory": "4Gi"}}


@pytest.mark.parametrize(
    "volume",
    [
        {"emptyDir": {}},
        {"emptyDir": {"sizeLimit": "30Gi"}},
        {"hostPath": {"path": "/mnt/kv", "type": "DirectoryOrCreate"}},
        {"persistentVolumeClaim": {"claimName": "kv-store"}},
    ],
    ids=["emptyDir", "emptyDir-sized", "hostPath", "pvc"],
)
def test_shared_volume_of_each_kind_is_mounted_and_named_in_the_flags(volume):
    spec = spec_of({"shared": {"volume": volume, "size": "20Gi"}})
    assert specs.validate("demo", spec) == []
    dep = deployment(spec)
    pod = dep["spec"]["template"]["spec"]
    ((kind, source),) = volume.items()
    assert {"name": "kv-shared", kind: source} in pod["volumes"]
    engine, sidecar = pod["containers"]
    assert {"name": "kv-shared", "mountPath": SHARED_DIR} in engine["volumeMounts"]
    assert all(m["name"] != "kv-shared" for m in sidecar["volumeMounts"])
    argv = engine["command"]
    assert flag(argv, "--kv-shared-dir") == SHARED_DIR and flag(argv, "--kv-shared-size") == "20"
    assert "--kv-offloading-size" not in argv
    kubernetes_validate.validate(dep, "1.37.0", strict=True)


def test_shared_size_defaults_to_10_gib():
    spec = spec_of({"shared": {"volume": {"emptyDir": {}}}})
    assert spec["engine"]["kvOffload"]["shared"]["size"] == "10Gi"
    assert flag(engine_container(spec)["command"], "--kv-shared-size") == "10"


@pytest.mark.parametrize(
    ("resources", "grown"),
    [
        (
            {"requests": {"memory": "8Gi", "cpu": "2"}, "limits": {"memory": "16Gi"}},
            {"requests": {"cpu": "2", "memory": "16Gi"}, "limits": {"memory": "24Gi"}},
        ),
        (
            {"limits": {"memory": "1G", "nvidia.com/gpu": 1}},
            {"limits": {"memory": str(10**9 + 8 * 2**30), "nvidia.com/gpu": 1}},
        ),
        ({"limits": {"nvidia.com/gpu": 1}}, {"limits": {"nvidia.com/gpu": 1}}),  # none set
        ({"requests": {"memory": 2**30}}, {"requests": {"memory": "9Gi"}}),
    ],
)
def test_host_memory_grows_the_memory_request_and_limit_where_set(resources, grown):
    spec = spec_of({"hostMemory": "8Gi"}, resources=resources)
    assert specs.validate("demo", spec) == []
    assert engine_container(spec)["resources"] == grown


def test_vllm_gets_the_host_tier_by_vllm_flags():
    spec = spec_of({"hostMemory": "4Gi"}, kind="vllm")
    assert specs.validate("demo", spec) == []
    argv = engine_container(spec)["command"]
    assert argv[:2] == ["vllm", "serve"]
    assert flag(argv, "--kv-offloading-size") == "4"
    assert flag(argv, "--kv-offloading-backend") == "native"


def test_a_changed_kv_offload_changes_the_pod_template():
    """A spec change reconciles the Deployment; a new pod template rolls the pods."""
    templates = [
        deployment(spec_of(kv))["spec"]["template"]
        for kv in (
            {"hostMemory": "4Gi"},
            {"hostMemory": "8Gi"},
            {"hostMemory": "8Gi", "shared": {"volume": {"emptyDir": {}}}},
            {"hostMemory": "8Gi", "shared": {"volume": {"emptyDir": {}}, "size": "5Gi"}},
        )
    ]
    assert all(a != b for a, b in zip(templates, templates[1:], strict=False))


def _errors(kv, **engine):
    return specs.validate("demo", spec_of(kv, **engine))


@pytest.mark.parametrize(
    ("kv", "engine", "field", "fragment"),
    [
        (
            {"shared": {"volume": {"emptyDir": {}, "hostPath": {"path": "/kv"}}}},
            {},
            "engine.kvOffload.shared.volume",
            "exactly one volume source",
        ),
        ({"shared": {"volume": {}}}, {}, "engine.kvOffload.shared.volume", "exactly one"),
        (
            {"shared": {"volume": {"hostPath": {"path": "var/kv"}}}},
            {},
            "spec.engine.kvOffload.shared.volume.hostPath.path",
            "does not match '^/'",
        ),
        ({"hostMemory": "8GB"}, {}, "spec.engine.kvOffload.hostMemory", "does not match"),
        ({"hostMemory": "lots"}, {}, "spec.engine.kvOffload.hostMemory", "does not match"),
        ({"hostMemory": 8}, {}, "spec.engine.kvOffload.hostMemory", "is not of type 'string'"),
        ({"hostMemory": "0"}, {}, "engine.kvOffload.hostMemory", "less than 1Mi"),
        (
            {"shared": {"volume": {"emptyDir": {}}, "size": "20 GiB"}},
            {},
            "spec.engine.kvOffload.shared.size",
            "does not match",
        ),
        (
            {"shared": {"volume": {"persistentVolumeClaim": {}}}},
            {},
            "spec.engine.kvOffload.shared.volume.persistentVolumeClaim",
            "'claimName' is a required property",
        ),
        (
            {"shared": {"volume": {"emptyDir": {}}}},
            {"kind": "vllm"},
            "engine.kvOffload.shared",
            "kvmesh's engine's",
        ),
        (
            {"hostMemory": "8Gi"},
            {"resources": {"limits": {"memory": "a lot"}}},
            "engine.resources.limits.memory",
            "not a quantity",
        ),
    ],
)
def test_bad_kv_offload_is_refused_naming_the_field(kv, engine, field, fragment):
    errors = _errors(kv, **engine)
    assert any(e.startswith(field) and fragment in e for e in errors), errors
