"""manifests/ and charts/kvmesh: valid Kubernetes objects, a chart that renders and
lints without a helm binary (helm-python-sdk embeds Helm's Go SDK), least privilege."""

from __future__ import annotations

from pathlib import Path

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvmesh.operator import crd, manifests

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvmesh"
K8S = "1.37.0"


def docs(text):
    return [d for d in yaml.safe_load_all(text) if d]


@pytest.mark.parametrize("name", ["crd.yaml", "rbac.yaml", "operator.yaml"])
def test_manifests_are_valid_kubernetes_objects(name):
    objs = docs((ROOT / "manifests" / name).read_text())
    assert objs
    for obj in objs:
        kubernetes_validate.validate(obj, K8S, strict=True)


def test_operator_deployment_is_non_root_with_liveness_probe():
    dep = next(d for d in docs((ROOT / "manifests/operator.yaml").read_text()) if d["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True and c["securityContext"]["runAsNonRoot"] is True
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["command"][:2] == ["kvmesh", "operator"]
    assert pod["serviceAccountName"] == manifests.NAME


def test_rbac_is_least_privilege():
    rules = manifests.RBAC_RULES
    for rule in rules:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
    granted = {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    # Never anything cluster-admin-ish.
    assert not any(r in ("namespaces", "customresourcedefinitions", "pods", "nodes", "roles", "clusterroles")
                   for _, r, _ in granted)
    assert ("", "secrets", "update") not in granted and ("apps", "deployments", "update") not in granted


def render_chart(values=None, namespace="kvmesh-system"):
    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(values or {}, name="kvmesh", namespace=namespace)
    return [d for name, text in sorted(out.items()) if name.endswith(".yaml") for d in docs(text)]


@pytest.mark.parametrize("values", [{}, {"watchNamespaces": ["team-a", "team-b"], "managedRedis": {"image": "r:1"}},
                                    {"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "x"}}])
def test_chart_renders_valid_objects(values):
    objs = render_chart(values)
    assert objs
    for obj in objs:
        kubernetes_validate.validate(obj, K8S, strict=True)
    kinds = {o["kind"] for o in objs}
    assert "Deployment" in kinds
    assert ("ClusterRole" in kinds) == values.get("rbac", {}).get("create", True)


def test_chart_operator_flags_and_rbac_match_the_manifests():
    objs = render_chart({"watchNamespaces": ["team-a"], "managedRedis": {"image": "redis:7"}})
    dep = next(o for o in objs if o["kind"] == "Deployment")
    cmd = dep["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[cmd.index("--namespace") + 1] == "team-a"
    assert cmd[cmd.index("--redis-image") + 1] == "redis:7"
    # The flags exist on `kvmesh operator`.
    import argparse

    from kvmesh.operator import cli
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(cmd[2:])
    assert args.namespace == ["team-a"] and args.redis_image == "redis:7" and args.liveness_port == 8080
    role = next(o for o in objs if o["kind"] == "ClusterRole")
    assert role["rules"] == manifests.RBAC_RULES


def test_chart_crd_is_the_generated_crd():
    crds = docs((CHART / "crds" / f"{crd.CRD_NAME}.yaml").read_text())
    assert crds == [crd.crd_manifest()]
    kubernetes_validate.validate(crds[0], K8S, strict=True)


def test_chart_lints_clean():
    result = helm.lint(str(CHART), strict=True)
    assert result["errors"] == [] and result["messages"] == []
    result = helm.lint(str(CHART), {"livenessPort": "not-a-port"})
    assert result["errors"] or result["messages"]


def test_values_schema():
    schema = yaml.safe_load((CHART / "values.schema.json").read_text())
    jsonschema.validate(yaml.safe_load((CHART / "values.yaml").read_text()), schema)
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema({"watchNamespaces": ["a"]})
        with pytest.raises(Exception):
            chart.validate_schema({"watchNamespaces": "not-a-list"})
        with pytest.raises(Exception):
            chart.validate_schema({"unknownKey": 1})
