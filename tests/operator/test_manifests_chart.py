"""manifests/ and charts/kvmesh: valid Kubernetes objects, a chart that renders and
lints without a helm binary (helm-python-sdk embeds Helm's Go SDK), least privilege
(ClusterRole or a Role per watched namespace, the Secret write guard), the optional
ServiceMonitor/PodMonitor, and the Grafana dashboard against the metrics the code exports."""

from __future__ import annotations

import argparse
import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import celpy
import helm_python as helm
import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client import CollectorRegistry

from kvmesh.engine.server.metrics import ServerMetrics
from kvmesh.operator import cli, crd, manifests, render
from kvmesh.operator import spec as specs
from kvmesh.router.metrics import RouterMetrics

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
    dep = next(
        d for d in docs((ROOT / "manifests/operator.yaml").read_text()) if d["kind"] == "Deployment"
    )
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert (
        pod["securityContext"]["runAsNonRoot"] is True
        and c["securityContext"]["runAsNonRoot"] is True
    )
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["command"][:2] == ["kvmesh", "operator"]
    assert pod["serviceAccountName"] == manifests.NAME


def test_rbac_is_least_privilege():
    rules = manifests.RBAC_RULES
    for rule in rules:
        assert (
            "*" not in rule["verbs"]
            and "*" not in rule["resources"]
            and "*" not in rule["apiGroups"]
        )
    granted = {
        (g, r, v)
        for rule in rules
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    # Never anything cluster-admin-ish.
    assert not any(
        r
        in (
            "namespaces",
            "customresourcedefinitions",
            "nodes",
            "clusterroles",
            "clusterrolebindings",
            "serviceaccounts/token",
            "pods/exec",
            "pods/attach",
            "pods/portforward",
            "pods/ephemeralcontainers",
        )
        for _, r, _ in granted
    )
    # Roles and RoleBindings only for the routers' own identity, and without `escalate` or
    # `bind`: the API server then refuses any Role granting more than the operator holds
    # itself, or a binding to one. What routers get is held by the operator (so it can grant it).
    assert not any(v in ("escalate", "bind", "impersonate") for _, _, v in granted)
    from kvmesh.operator import render

    router_grants = {
        (g, r, v)
        for rule in render.ROUTER_RULES
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    assert router_grants <= granted, router_grants - granted
    # Pods belong to the engine Deployments: the autoscaler may read them and annotate their
    # deletion cost, never create, delete or replace one.
    assert {v for _, r, v in granted if r == "pods"} <= {"get", "list", "watch", "patch"}
    assert ("", "secrets", "update") not in granted and (
        "apps",
        "deployments",
        "update",
    ) not in granted


def render_chart(values=None, namespace="kvmesh-system"):
    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(values or {}, name="kvmesh", namespace=namespace)
    return [d for name, text in sorted(out.items()) if name.endswith(".yaml") for d in docs(text)]


ALL_ON = {
    "metrics": {
        "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}
    },
    "grafana": {"dashboard": {"enabled": True, "annotations": {"grafana_folder": "LLM serving"}}},
}

# Kinds the chart renders that are not built into Kubernetes (no schema in kubernetes-validate).
MONITORING_KINDS = {"ServiceMonitor", "PodMonitor"}


def validate(obj):
    if obj["kind"] in MONITORING_KINDS:
        jsonschema.validate(obj, MONITOR_SCHEMAS[obj["kind"]])
    else:
        kubernetes_validate.validate(obj, K8S, strict=True)


@pytest.mark.parametrize(
    "values",
    [
        {},
        {"watchNamespaces": ["team-a", "team-b"], "managedRedis": {"image": "r:1"}},
        {"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "x"}},
        {"rbac": {"secretWriteGuard": False}},
        ALL_ON,
        {
            "watchNamespaces": ["team-a"],
            "metrics": {"podMonitor": {"enabled": True}, "components": ["engine"]},
            "grafana": {"dashboard": {"enabled": True, "namespace": "monitoring"}},
        },
    ],
)
def test_chart_renders_valid_objects(values):
    objs = render_chart(values)
    assert objs
    for obj in objs:
        validate(obj)
    kinds = [o["kind"] for o in objs]
    assert "Deployment" in kinds
    rbac = values.get("rbac", {}).get("create", True)
    namespaced = bool(values.get("watchNamespaces"))
    assert ("ClusterRole" in kinds) == ("ClusterRoleBinding" in kinds) == (rbac and not namespaced)
    assert (
        kinds.count("Role")
        == kinds.count("RoleBinding")
        == (len(values["watchNamespaces"]) if rbac and namespaced else 0)
    )
    guard = rbac and values.get("rbac", {}).get("secretWriteGuard", True)
    assert (
        ("ValidatingAdmissionPolicy" in kinds)
        == ("ValidatingAdmissionPolicyBinding" in kinds)
        == guard
    )
    metrics = values.get("metrics", {})
    for kind, key in (("ServiceMonitor", "serviceMonitor"), ("PodMonitor", "podMonitor")):
        assert kinds.count(kind) == (1 if metrics.get(key, {}).get("enabled") else 0)
    dashboard = values.get("grafana", {}).get("dashboard", {}).get("enabled", False)
    assert kinds.count("ConfigMap") == (1 if dashboard else 0)


def operator_args(objs):
    dep = next(o for o in objs if o["kind"] == "Deployment")
    cmd = dep["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[:2] == ["kvmesh", "operator"]
    # The flags exist on `kvmesh operator`.
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(cmd[2:])


def test_chart_operator_flags_and_rbac_match_the_manifests():
    objs = render_chart({"watchNamespaces": ["team-a"], "managedRedis": {"image": "redis:7"}})
    args = operator_args(objs)
    assert (
        args.namespace == ["team-a"]
        and args.redis_image == "redis:7"
        and args.liveness_port == 8080
    )
    role = next(o for o in objs if o["kind"] == "Role")
    assert role["rules"] == manifests.RBAC_RULES
    role = next(o for o in render_chart() if o["kind"] == "ClusterRole")
    assert role["rules"] == manifests.RBAC_RULES


# -- least privilege: namespace-scoped install ------------------------------------------------------


def test_namespaced_install_grants_the_rules_only_in_the_watched_namespaces():
    watched = ["team-a", "team-b"]
    objs = render_chart({"watchNamespaces": watched}, namespace="ops")
    assert operator_args(objs).namespace == watched
    cluster_rbac = [o for o in objs if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    assert cluster_rbac == []
    roles = {o["metadata"]["namespace"]: o for o in objs if o["kind"] == "Role"}
    bindings = {o["metadata"]["namespace"]: o for o in objs if o["kind"] == "RoleBinding"}
    assert sorted(roles) == sorted(bindings) == watched
    sa = next(o for o in objs if o["kind"] == "ServiceAccount")
    assert sa["metadata"]["namespace"] == "ops"
    for ns in watched:
        assert roles[ns]["rules"] == manifests.RBAC_RULES
        b = bindings[ns]
        assert b["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": roles[ns]["metadata"]["name"],
        }
        assert b["subjects"] == [
            {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "ops"}
        ]
    # The chart and manifests.namespaced_rbac() describe the same install (names aside).
    py = manifests.namespaced_rbac(watched, namespace="ops")

    def shape(objs):
        return sorted(
            (o["kind"], o["metadata"].get("namespace"), json.dumps(o.get("rules")))
            for o in objs
            if o["kind"] in ("ServiceAccount", "Role", "RoleBinding")
        )

    assert shape(py) == shape(objs)
    for obj in py:
        kubernetes_validate.validate(obj, K8S, strict=True)


def test_docs_rbac_section_names_every_resource_granted():
    text = (ROOT / "docs" / "operator.md").read_text()
    section = text.split("\n## RBAC\n", 1)[1].split("\n## ", 1)[0]
    missing = [
        r
        for rule in manifests.RBAC_RULES
        for r in rule["resources"]
        if not re.search(rf"(?<![\w/-]){re.escape(r)}(?![\w/-])", section)
    ]
    assert not missing, (
        f"docs/operator.md's RBAC section does not say why the operator needs {missing}"
    )


def test_chart_operator_pod_passes_the_network_policies_that_admit_the_operator():
    """The operator reads the managed Redis (heartbeats): a NetworkPolicy that admits the
    operator by its pod labels must select the pod the chart runs."""
    (operator_pod,) = pod_templates(render_chart()).values()
    peers = [
        peer
        for c in rendered_children()
        if c["kind"] == "NetworkPolicy"
        for rule in c["spec"].get("ingress", [])
        for peer in rule.get("from", [])
        if (peer.get("podSelector", {}).get("matchLabels") or {}).get(render.LABEL_COMPONENT)
        == "operator"
    ]
    if not peers:
        pytest.skip("no rendered NetworkPolicy admits the operator by its labels")
    for peer in peers:
        assert selects(peer["podSelector"], operator_pod["metadata"]["labels"]), peer


def test_namespaced_rbac_refuses_rules_a_role_cannot_grant(monkeypatch):
    # Every rule the operator needs is namespaced today, so a Role per namespace loses nothing...
    manifests.namespaced_rbac(["team-a"])
    # ...and whoever adds a cluster-scoped one hears that the namespaced install needs a ClusterRole for it.
    monkeypatch.setattr(
        manifests,
        "RBAC_RULES",
        manifests.RBAC_RULES + [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]}],
    )
    with pytest.raises(ValueError, match="nodes"):
        manifests.namespaced_rbac(["team-a"])
    with pytest.raises(ValueError):
        manifests.namespaced_rbac([])


# -- least privilege: the Secret write guard (ValidatingAdmissionPolicy) ----------------------------

MD = {
    "apiVersion": crd.API_VERSION,
    "kind": crd.KIND,
    "metadata": {"name": "demo", "namespace": "prod", "uid": "0d3b1f0e-uid", "generation": 1},
}


def rendered_children(spec=None):
    return render.render_children(
        MD, specs.apply_defaults(spec or {"model": {"builtin": crd.DEFAULT_MODEL}})
    )


def operator_secrets():
    """Every Secret the operator writes: rendered children, and the credentials it generates
    (render.generated_secret, where this version of the renderer has them)."""
    out = []
    for spec in (
        {"model": {"builtin": crd.DEFAULT_MODEL}},
        {
            "model": {"builtin": crd.DEFAULT_MODEL},
            "redis": {"mode": "external", "url": "redis://r:6379/0"},
        },
    ):
        full = specs.apply_defaults(spec)
        out += [c for c in render.render_children(MD, full) if c["kind"] == "Secret"]
        if hasattr(render, "generated_secret_names"):
            out += [
                render.generated_secret(MD, full, n, "t0ken")
                for n in render.generated_secret_names("demo", full)
            ]
    return out


def guard_programs(objs):
    (policy,) = [o for o in objs if o["kind"] == "ValidatingAdmissionPolicy"]
    (binding,) = [o for o in objs if o["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert binding["spec"] == {
        "policyName": policy["metadata"]["name"],
        "validationActions": ["Deny"],
    }
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["secrets"] and rule["apiGroups"] == [""]
    assert set(rule["operations"]) == {"CREATE", "UPDATE", "DELETE"}
    env = celpy.Environment()

    def compile_(e):
        return env.program(env.compile(e))

    return (
        [compile_(c["expression"]) for c in spec["matchConditions"]],
        [compile_(v["expression"]) for v in spec["validations"]],
    )


def admitted(programs, operation, obj, old, user):
    conditions, validations = programs
    act = {
        "request": celpy.json_to_cel({"operation": operation, "userInfo": {"username": user}}),
        "object": celpy.json_to_cel(obj),
        "oldObject": celpy.json_to_cel(old),
    }
    if not all(bool(c.evaluate(act)) for c in conditions):
        return True  # the policy does not apply to this request
    return all(bool(v.evaluate(act)) for v in validations)


def test_secret_write_guard_admits_only_the_operators_own_secrets():
    objs = render_chart(namespace="ops")
    programs = guard_programs(objs)
    sa = next(o for o in objs if o["kind"] == "ServiceAccount")["metadata"]["name"]
    operator = f"system:serviceaccount:ops:{sa}"
    owned = operator_secrets()
    assert owned, "the operator writes Secrets (the Redis URL at least) to check the policy against"
    for secret in owned:
        changed = {**secret, "data": {"url": "cmVkaXM6Ly9vdGhlcjo2Mzc5LzA="}}
        assert admitted(programs, "CREATE", secret, None, operator)
        assert admitted(programs, "UPDATE", changed, secret, operator)
        assert admitted(programs, "DELETE", None, secret, operator)
    foreign = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "db", "namespace": "prod"},
        "data": {"password": "aHVudGVyMg=="},
    }
    labelled = {
        **foreign,
        "metadata": {**foreign["metadata"], "labels": owned[0]["metadata"]["labels"]},
    }
    assert not admitted(programs, "CREATE", foreign, None, operator)
    assert not admitted(programs, "UPDATE", foreign, foreign, operator)
    assert not admitted(
        programs, "UPDATE", labelled, foreign, operator
    )  # no adopting by relabelling
    assert not admitted(programs, "UPDATE", foreign, owned[0], operator)  # no stripping its labels
    assert not admitted(programs, "DELETE", None, foreign, operator)
    # Only the operator's ServiceAccount is constrained.
    assert admitted(programs, "DELETE", None, foreign, "system:serviceaccount:other:kvmesh")
    assert admitted(programs, "CREATE", foreign, None, "alice@example.com")


# -- monitoring: ServiceMonitor / PodMonitor ---------------------------------------------------------

# The fields of the Prometheus Operator's monitoring.coreos.com/v1 CRDs that the chart uses,
# closed (additionalProperties false) so that a misspelt field fails here and not in a cluster.
DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
    r"(([0-9]+)s)?(([0-9]+)ms)?)$",
}
LABEL_NAME = {"type": "string", "pattern": r"^[a-zA-Z_][a-zA-Z0-9_]*$"}
RELABEL = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "sourceLabels": {"type": "array", "items": LABEL_NAME},
        "separator": {"type": "string"},
        "targetLabel": {"type": "string"},
        "regex": {"type": "string"},
        "modulus": {"type": "integer"},
        "replacement": {"type": "string"},
        "action": {
            "enum": [
                "replace",
                "Replace",
                "keep",
                "Keep",
                "drop",
                "Drop",
                "hashmod",
                "HashMod",
                "labelmap",
                "LabelMap",
                "labeldrop",
                "LabelDrop",
                "labelkeep",
                "LabelKeep",
                "lowercase",
                "Lowercase",
                "uppercase",
                "Uppercase",
                "keepequal",
                "KeepEqual",
                "dropequal",
                "DropEqual",
            ]
        },
    },
}
ENDPOINT = {
    "type": "object",
    "additionalProperties": False,
    "required": ["port"],
    "properties": {
        "port": {"type": "string", "minLength": 1},
        "path": {"type": "string", "pattern": "^/"},
        "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
        "interval": DURATION,
        "scrapeTimeout": DURATION,
        "relabelings": {"type": "array", "items": RELABEL},
        "metricRelabelings": {"type": "array", "items": RELABEL},
    },
}
SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["key", "operator"],
                "properties": {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}


def _monitor_schema(kind, endpoints):
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": kind},
            "metadata": {
                "type": "object",
                "required": ["name", "namespace"],
                "properties": {
                    "name": {"type": "string"},
                    "namespace": {"type": "string"},
                    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                },
            },
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": ["selector", endpoints],
                "properties": {
                    "selector": SELECTOR,
                    "namespaceSelector": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "any": {"type": "boolean"},
                            "matchNames": {"type": "array", "items": {"type": "string"}},
                        },
                    },
                    endpoints: {"type": "array", "minItems": 1, "items": ENDPOINT},
                },
            },
        },
    }


MONITOR_SCHEMAS = {
    "ServiceMonitor": _monitor_schema("ServiceMonitor", "endpoints"),
    "PodMonitor": _monitor_schema("PodMonitor", "podMetricsEndpoints"),
}


def selects(selector, labels):
    """Kubernetes label-selector semantics."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        present, value = e["key"] in labels, labels.get(e["key"])
        ok = {
            "In": present and value in e.get("values", []),
            "NotIn": not present or value not in e.get("values", []),
            "Exists": present,
            "DoesNotExist": not present,
        }[e["operator"]]
        if not ok:
            return False
    return True


def meta_label(label):
    """The __meta_kubernetes_pod_label_* name Prometheus' Kubernetes discovery gives a pod label."""
    return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", label)


def pod_templates(objs):
    return {o["metadata"]["name"]: o["spec"]["template"] for o in objs if o["kind"] == "Deployment"}


@pytest.mark.parametrize(
    "kind,key", [("ServiceMonitor", "serviceMonitor"), ("PodMonitor", "podMonitor")]
)
def test_monitor_scrapes_engines_and_routers_on_their_metrics_port(kind, key):
    objs = render_chart(
        {"metrics": {key: {"enabled": True, "interval": "15s", "labels": {"release": "kps"}}}}
    )
    (mon,) = [o for o in objs if o["kind"] == kind]
    validate(mon)
    assert mon["metadata"]["namespace"] == "kvmesh-system"
    assert mon["metadata"]["labels"]["release"] == "kps"
    assert mon["spec"]["namespaceSelector"] == {"any": True}
    (ep,) = mon["spec"]["endpoints" if kind == "ServiceMonitor" else "podMetricsEndpoints"]
    assert ep["port"] == "metrics" and ep["path"] == "/metrics" and ep["interval"] == "15s"
    children = rendered_children()
    pods = pod_templates(children)
    if kind == "ServiceMonitor":  # selects Services; the port name is the Service's
        targets = {
            o["metadata"]["name"]: o
            for o in children
            if o["kind"] == "Service" and selects(mon["spec"]["selector"], o["metadata"]["labels"])
        }
        for svc in targets.values():
            assert "metrics" in [p["name"] for p in svc["spec"]["ports"]]
    else:  # selects pods; the port name is a container port's
        targets = {
            n: t
            for n, t in pods.items()
            if selects(mon["spec"]["selector"], t["metadata"]["labels"])
        }
        for t in targets.values():
            assert "metrics" in [
                p.get("name") for c in t["spec"]["containers"] for p in c.get("ports", [])
            ]
    names = render.names("demo")
    assert set(targets) == {names[render.ENGINE], names[render.ROUTER]}  # not Redis
    # Not the operator's own pod (same app.kubernetes.io/name), which has no /metrics.
    (operator_pod,) = pod_templates(objs).values()
    assert not selects(mon["spec"]["selector"], operator_pod["metadata"]["labels"])
    # The relabelings read labels the operator really puts on its pods.
    relabel = {r["targetLabel"]: r["sourceLabels"] for r in ep["relabelings"]}
    for pod in (pods[names[render.ENGINE]], pods[names[render.ROUTER]]):
        have = {meta_label(k) for k in pod["metadata"]["labels"]}
        assert (
            relabel["model_deployment"] == [meta_label(render.LABEL_MD)]
            and set(relabel["model_deployment"]) <= have
        )
        assert (
            relabel["component"] == [meta_label(render.LABEL_COMPONENT)]
            and set(relabel["component"]) <= have
        )


def test_engine_network_policy_admits_scrapers_on_the_scraped_port():
    """The monitors scrape the engine's `metrics` port; the NetworkPolicy in front of the engines
    must let a Prometheus labelled (or in a namespace labelled) as a scraper reach that port,
    as docs/operator.md tells users to do, and no other (the API stays the routers')."""
    children = rendered_children()
    names = render.names("demo")
    engine_pod = pod_templates(children)[names[render.ENGINE]]
    (port,) = [
        p["containerPort"]
        for c in engine_pod["spec"]["containers"]
        for p in c.get("ports", [])
        if p.get("name") == "metrics"
    ]
    (policy,) = [
        c
        for c in children
        if c["kind"] == "NetworkPolicy"
        and selects(c["spec"]["podSelector"], engine_pod["metadata"]["labels"])
    ]
    scraper = {render.LABEL_SCRAPER: "true"}

    def admits(peer_ok):
        return any(
            any(peer_ok(peer) for peer in rule.get("from", []))
            and any(p.get("port") in (port, "metrics") for p in rule.get("ports", []))
            for rule in policy["spec"]["ingress"]
        )

    # A Prometheus namespace labelled as a scraper (any pod in it) ...
    assert admits(
        lambda peer: (
            "podSelector" not in peer
            and selects(peer.get("namespaceSelector", {"matchLabels": {"-": "-"}}), scraper)
        )
    )
    # ... or a labelled Prometheus pod in the engines' namespace.
    assert admits(
        lambda peer: (
            "namespaceSelector" not in peer
            and selects(peer.get("podSelector", {"matchLabels": {"-": "-"}}), scraper)
        )
    )
    # The API port admits this deployment's routers only.
    api_rules = [
        rule
        for rule in policy["spec"]["ingress"]
        if any(p.get("port") in (8000, "http") for p in rule.get("ports", []))
    ]
    assert [peer for rule in api_rules for peer in rule["from"]] == [
        {"podSelector": {"matchLabels": render.selector("demo", render.ROUTER)}}
    ]


def test_monitor_options():
    objs = render_chart(
        {
            "watchNamespaces": ["team-a", "team-b"],
            "metrics": {
                "components": ["engine"],
                "podMonitor": {
                    "enabled": True,
                    "namespace": "monitoring",
                    "scrapeTimeout": "5s",
                    "relabelings": [{"targetLabel": "cluster", "replacement": "eu-1"}],
                    "metricRelabelings": [
                        {"action": "drop", "sourceLabels": ["__name__"], "regex": "process_.*"}
                    ],
                },
            },
        }
    )
    (mon,) = [o for o in objs if o["kind"] == "PodMonitor"]
    validate(mon)
    assert mon["metadata"]["namespace"] == "monitoring"
    assert mon["spec"]["namespaceSelector"] == {
        "matchNames": ["team-a", "team-b"]
    }  # from watchNamespaces
    (ep,) = mon["spec"]["podMetricsEndpoints"]
    assert ep["scrapeTimeout"] == "5s"
    assert ep["relabelings"][-1] == {
        "targetLabel": "cluster",
        "replacement": "eu-1",
    }  # after the chart's own
    assert [r["targetLabel"] for r in ep["relabelings"][:2]] == ["model_deployment", "component"]
    assert ep["metricRelabelings"] == [
        {"action": "drop", "sourceLabels": ["__name__"], "regex": "process_.*"}
    ]
    pods = pod_templates(rendered_children())
    names = render.names("demo")
    assert selects(mon["spec"]["selector"], pods[names[render.ENGINE]]["metadata"]["labels"])
    assert not selects(mon["spec"]["selector"], pods[names[render.ROUTER]]["metadata"]["labels"])
    # An explicit namespaceSelector wins over watchNamespaces.
    (mon,) = [
        o
        for o in render_chart(
            {
                "watchNamespaces": ["team-a"],
                "metrics": {
                    "serviceMonitor": {"enabled": True, "namespaceSelector": {"any": True}}
                },
            }
        )
        if o["kind"] == "ServiceMonitor"
    ]
    assert mon["spec"]["namespaceSelector"] == {"any": True}


def test_service_and_pod_monitor_together_are_refused():
    with pytest.raises(helm.HelmError, match="enable one"):
        render_chart(
            {"metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}}
        )


# -- the Grafana dashboard ---------------------------------------------------------------------------

DASHBOARD = CHART / "dashboards" / "kvmesh.json"


def registered_metric_names():
    """Every sample name the engine server and the router expose on /metrics, as Prometheus
    stores them (prometheus_client adds _total to counters, _bucket/_sum/_count to histograms)."""
    # stats=None: the engine before its first step, when the collector still yields every family.
    # speculative_config set: the spec-decode families are exported only when it is.
    engine = SimpleNamespace(
        stats=None,
        num_in_flight=0,
        engine_args=SimpleNamespace(
            block_size=16,
            enable_prefix_caching=True,
            dtype="float32",
            speculative_config={"method": "ngram", "num_speculative_tokens": 4},
        ),
    )
    registries: list[CollectorRegistry] = [
        ServerMetrics(engine, "m").registry,
        RouterMetrics().registry,
    ]
    suffixes = {
        "counter": ["_total", "_created"],
        "histogram": ["_bucket", "_sum", "_count", "_created"],
        "summary": ["", "_sum", "_count", "_created"],
        "gauge": [""],
        "info": ["_info"],
        "stateset": [""],
        "gaugehistogram": ["_bucket", "_gsum", "_gcount"],
        "unknown": [""],
    }
    names = set()
    for registry in registries:
        for family in registry.collect():
            names |= {family.name + s for s in suffixes[family.type]}
            names |= {s.name for s in family.samples}
    return names


PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
}


def promql_metric_names(expr):
    """Metric names a PromQL expression selects (Grafana's label_values(selector, label) too)."""
    m = re.fullmatch(r"\s*label_values\((.*),\s*[a-zA-Z_]\w*\s*\)\s*", expr, re.S)
    if m:
        expr = m.group(1)
    expr = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)  # strings
    expr = re.sub(r"\{[^}]*\}", " ", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", " ", expr)  # ranges
    expr = re.sub(
        r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr
    )  # label lists
    expr = re.sub(r"\boffset\s+-?[0-9a-z]+", " ", expr)  # offset 5m
    expr = re.sub(r"(?<![\w:])\d+(\.\d+)?([eE][+-]?\d+)?", " ", expr)  # numbers
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
        if expr[m.end() :].lstrip().startswith("("):  # a function or an aggregation
            continue
        if m.group(0).lower() not in PROMQL_WORDS:
            names.add(m.group(0))
    return names


def dashboard_queries(dash):
    out = []

    def walk(panels):
        for p in panels:
            out.extend((p["title"], t["expr"]) for t in p.get("targets", []))
            walk(p.get("panels", []))

    walk(dash["panels"])
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]
            out.append((f"variable {v['name']}", q["query"] if isinstance(q, dict) else q))
    return out


def test_promql_metric_name_extraction():
    assert promql_metric_names(
        'histogram_quantile(0.99, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket{namespace=~"$ns", '
        'le!="+Inf"}[$__rate_interval]))) / on (pod) group_left max by (pod) (kvmesh:draining offset 5m)'
    ) == {"vllm:time_to_first_token_seconds_bucket", "kvmesh:draining"}
    assert promql_metric_names(
        'label_values(vllm:num_requests_running{namespace=~"a"}, model_deployment)'
    ) == {"vllm:num_requests_running"}
    assert promql_metric_names("sum(rate(a_total[5m])) / sum(rate(b_total[5m])) > 1e3 and c") == {
        "a_total",
        "b_total",
        "c",
    }


def test_dashboard_uses_only_metrics_the_code_exports():
    """A renamed or removed metric fails here, not on a blank panel in production."""
    dash = json.loads(DASHBOARD.read_text())
    exported = registered_metric_names()
    assert {
        "vllm:time_to_first_token_seconds_bucket",
        "kvmesh_router_prompt_tokens_total",
    } <= exported
    used = {}
    for where, expr in dashboard_queries(dash):
        for name in promql_metric_names(expr):
            used.setdefault(name, where)
    unknown = {n: w for n, w in used.items() if n not in exported}
    assert not unknown, f"the dashboard queries metrics that no kvmesh code exports: {unknown}"
    # What the dashboard must show, by the metrics that carry it.
    wanted = {
        "TTFT": "vllm:time_to_first_token_seconds_bucket",
        "ITL": "vllm:inter_token_latency_seconds_bucket",
        "prompt throughput": "vllm:prompt_tokens_total",
        "generation throughput": "vllm:generation_tokens_total",
        "KV usage": "vllm:kv_cache_usage_perc",
        "engine prefix hits": "vllm:prefix_cache_hits_total",
        "engine prefix queries": "vllm:prefix_cache_queries_total",
        "router-predicted cached tokens": "kvmesh_router_predicted_cached_tokens_total",
        "router prompt tokens": "kvmesh_router_prompt_tokens_total",
        "running": "vllm:num_requests_running",
        "waiting": "vllm:num_requests_waiting",
        "router pods": "kvmesh_router_pods",
    }
    missing = {what: name for what, name in wanted.items() if name not in used}
    assert not missing, f"dashboard panels missing: {missing}"
    # The check does fail on a renamed metric.
    renamed = json.loads(
        DASHBOARD.read_text().replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    )
    names = {n for _, e in dashboard_queries(renamed) for n in promql_metric_names(e)}
    assert "vllm:gpu_cache_usage_perc" in names - exported


FILTER = '{namespace=~"$namespace", model_deployment=~"$model_deployment"'


def test_dashboard_panels_filter_by_the_variables_and_use_the_datasource_variable():
    dash = json.loads(DASHBOARD.read_text())
    exported = registered_metric_names()
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource"
        and variables["datasource"]["query"] == "prometheus"
    )
    for name in ("namespace", "model_deployment"):  # labels the monitors put on every target
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        for t in p["targets"]:
            # Every selector of a kvmesh/vLLM metric honours the dashboard's filters.
            selectors = [
                m
                for m in re.finditer(r"(?<![\w:])[a-zA-Z_:][\w:]*", t["expr"])
                if m.group(0) in exported
            ]
            assert selectors, (p["title"], t["expr"])
            for m in selectors:
                assert t["expr"][m.end() :].startswith(FILTER), (p["title"], t["expr"])
    # No two panels overlap.
    cells = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & mine, p["title"]
        cells |= mine


def test_dashboard_configmap():
    assert not [o for o in render_chart() if o["kind"] == "ConfigMap"]  # off by default
    objs = render_chart(
        {
            "grafana": {
                "dashboard": {
                    "enabled": True,
                    "namespace": "monitoring",
                    "annotations": {"grafana_folder": "LLM"},
                }
            }
        }
    )
    (cm,) = [o for o in objs if o["kind"] == "ConfigMap"]
    kubernetes_validate.validate(cm, K8S, strict=True)
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    assert json.loads(cm["data"]["kvmesh.json"]) == json.loads(DASHBOARD.read_text())
    assert len(cm["data"]["kvmesh.json"].encode()) < 1024 * 1024  # a ConfigMap's limit
    # The sidecar's label is configurable (e.g. another label selector on Grafana's sidecar).
    (cm,) = [
        o
        for o in render_chart(
            {"grafana": {"dashboard": {"enabled": True, "labels": {"team": "llm"}}}}
        )
        if o["kind"] == "ConfigMap"
    ]
    assert (
        cm["metadata"]["labels"]["team"] == "llm"
        and cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    )


def test_chart_crd_is_the_generated_crd():
    crds = docs((CHART / "crds" / f"{crd.CRD_NAME}.yaml").read_text())
    assert crds == [crd.crd_manifest()]
    kubernetes_validate.validate(crds[0], K8S, strict=True)


def test_chart_lints_clean():
    result = helm.lint(str(CHART), strict=True)
    assert result["errors"] == [] and result["messages"] == []
    for values in (
        ALL_ON,
        {"watchNamespaces": ["a"], "metrics": {"podMonitor": {"enabled": True}}},
    ):
        result = helm.lint(str(CHART), values, strict=True)
        assert result["errors"] == [] and result["messages"] == [], values
    result = helm.lint(
        str(CHART), strict=True, kube_version="1.29.0"
    )  # no ValidatingAdmissionPolicy API
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


GOOD_VALUES = [
    {"watchNamespaces": ["team-a", "b2"]},
    {"rbac": {"create": True, "secretWriteGuard": False}},
    {
        "metrics": {
            "components": ["router"],
            "serviceMonitor": {
                "enabled": True,
                "namespace": "monitoring",
                "labels": {"release": "kps"},
                "interval": "1m30s",
                "scrapeTimeout": "10s",
                "namespaceSelector": {"matchNames": ["team-a"]},
                "relabelings": [
                    {
                        "action": "replace",
                        "sourceLabels": ["__meta_kubernetes_pod_node_name"],
                        "targetLabel": "node",
                    }
                ],
                "metricRelabelings": [
                    {"action": "drop", "sourceLabels": ["__name__"], "regex": "process_.*"}
                ],
            },
        }
    },
    {"metrics": {"podMonitor": {"enabled": True, "namespaceSelector": {"any": True}}}},
    {
        "grafana": {
            "dashboard": {
                "enabled": True,
                "namespace": "",
                "labels": {"grafana_dashboard": "1"},
                "annotations": {"grafana_folder": "LLM"},
            }
        }
    },
]
BAD_VALUES = [
    {"watchNamespaces": ["Team_A"]},  # not a namespace name
    {"watchNamespaces": ["a", "a"]},
    {"rbac": {"secretWriteGuard": "yes"}},
    {"metrics": {"components": ["redis"]}},  # Redis has no /metrics
    {"metrics": {"components": []}},
    {"metrics": {"serviceMonitor": {"enabled": "true"}}},
    {"metrics": {"serviceMonitor": {"interval": "30 seconds"}}},
    {"metrics": {"serviceMonitor": {"interval": ""}}},
    {"metrics": {"podMonitor": {"labels": {"release": 1}}}},
    {"metrics": {"podMonitor": {"namespaceSelector": {"matchNames": "team-a"}}}},
    {"metrics": {"podMonitor": {"relabelings": [{"action": "rename"}]}}},
    {"metrics": {"serviceMonitor": {"enabled": True, "port": "metrics"}}},  # unknown key
    {"metrics": {"serviceMonitor": {"namespace": "Monitoring"}}},
    {"grafana": {"dashboard": {"enabled": 1}}},
    {"grafana": {"dashboard": {"annotations": {"grafana_folder": ["a"]}}}},
    {"grafana": {"datasource": "prom"}},
]


@pytest.mark.parametrize("values", GOOD_VALUES)
def test_values_schema_admits_the_new_values(values):
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema(values)


@pytest.mark.parametrize("values", BAD_VALUES)
def test_values_schema_rejects_bad_values(values):
    with helm.Chart.load(str(CHART)) as chart:
        with pytest.raises(helm.HelmError):
            chart.validate_schema(values)
    schema = json.loads((CHART / "values.schema.json").read_text())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(values, schema)


# -- the chart's namespaced RBAC and Secret write guard on a real kube-apiserver -------------------
# Runs when kube-apiserver and etcd are found (tests/operator/apiserver_env.py; docs/operator.md,
# "Testing against a real API server"), skipped otherwise: RBAC and ValidatingAdmissionPolicy are
# enforced by the API server itself, so no controller manager is needed.

RELEASE_NS, WATCHED, UNWATCHED = "ops", "team-a", "team-b"


@pytest.fixture(scope="module")
def real_cluster(tmp_path_factory):
    try:
        from tests.operator import apiserver_env as env
    except ImportError as exc:  # pragma: no cover - the helper ships with the operator tests
        pytest.skip(f"no apiserver_env: {exc}")
    assets, why = env.find_environment()
    if assets is None:
        pytest.skip(f"no real control plane: {why}")
    env.register_kind(crd.KIND, crd.API_VERSION, crd.PLURAL)
    for kind, api_version, plural, namespaced in (
        ("Role", "rbac.authorization.k8s.io/v1", "roles", True),
        ("RoleBinding", "rbac.authorization.k8s.io/v1", "rolebindings", True),
        (
            "ValidatingAdmissionPolicy",
            "admissionregistration.k8s.io/v1",
            "validatingadmissionpolicies",
            False,
        ),
        (
            "ValidatingAdmissionPolicyBinding",
            "admissionregistration.k8s.io/v1",
            "validatingadmissionpolicybindings",
            False,
        ),
    ):
        env.register_kind(kind, api_version, plural, namespaced)
    cp = env.ControlPlane(assets, tmp_path_factory.mktemp("chart-apiserver"))
    try:
        cp.start()
        for ns in (RELEASE_NS, WATCHED, UNWATCHED):
            cp.apply(
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
            ).raise_for_status()
        # The chart as `helm install -n ops --set watchNamespaces={team-a}` would create it
        # (the operator Deployment aside: no nodes here, the operator runs in this process).
        objs = render_chart({"watchNamespaces": [WATCHED]}, namespace=RELEASE_NS)
        for obj in objs:
            if obj["kind"] != "Deployment":
                resp = cp.apply(obj)
                assert resp.status_code < 300, (obj["kind"], resp.text)
        sa = next(o for o in objs if o["kind"] == "ServiceAccount")["metadata"]["name"]
        token = cp.request_token(RELEASE_NS, sa)
        client = httpx.Client(
            base_url=cp.server,
            verify=cp.ssl_context(),
            timeout=30.0,
            headers={"Authorization": f"Bearer {token}"},
        )
        yield SimpleNamespace(cp=cp, env=env, objs=objs, sa=sa, token=token, client=client)
        client.close()
    finally:
        cp.stop()


def _secret(name, ns, labels=None):
    meta = {"name": name, "namespace": ns, **({"labels": labels} if labels else {})}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "data": {"k": "dg=="}}


def test_real_apiserver_enforces_the_namespaced_role_and_the_secret_write_guard(real_cluster):
    cp, env, op = real_cluster.cp, real_cluster.env, real_cluster.client
    # (The API server compiled the policy's CEL when the chart's objects were applied: a
    # syntax or undeclared-variable error would have been a 422 there.)
    # RBAC: the Role grants the rules in the watched namespace only.
    assert op.get(env.path("Secret", WATCHED)).status_code == 200
    assert op.get(env.path("Deployment", WATCHED)).status_code == 200
    for forbidden in (
        env.path("Secret", UNWATCHED),
        env.path("Secret"),
        env.path("Deployment", UNWATCHED),
        env.path("Deployment"),
    ):
        assert op.get(forbidden).status_code == 403, forbidden
    # The admission policy: the operator's ServiceAccount cannot write a Secret it does not own.
    foreign = _secret("db", WATCHED)

    def refused():  # the policy takes effect once the API server has loaded it
        resp = op.post(env.path("Secret", WATCHED), json=foreign, params={"dryRun": "All"})
        return resp if resp.status_code != 201 else None

    resp = env.wait_for(
        refused, timeout=20, interval=0.2, message="the Secret write guard in force"
    )
    assert resp.status_code == 403 and "kvmesh-secret-writes" in resp.text, resp.text
    cp.apply(foreign).raise_for_status()  # a Secret someone else made
    owned_labels = {render.LABEL_MD: "demo", "app.kubernetes.io/managed-by": render.FIELD_MANAGER}
    adopt = {**foreign, "metadata": {**foreign["metadata"], "labels": owned_labels}}
    assert op.delete(env.path("Secret", WATCHED, "db")).status_code == 403
    assert (
        op.put(env.path("Secret", WATCHED, "db"), json=adopt).status_code == 403
    )  # no adopting by labels
    assert cp.get("Secret", WATCHED, "db") is not None
    # Its own Secrets it creates, changes (server-side apply, as it does) and deletes.
    mine = _secret("demo-redis-url", WATCHED, owned_labels)
    apply = {"Content-Type": "application/apply-patch+yaml"}
    params = {"fieldManager": render.FIELD_MANAGER, "force": "true"}
    resp = op.patch(
        env.path("Secret", WATCHED, "demo-redis-url"),
        content=json.dumps(mine),
        headers=apply,
        params=params,
    )
    assert resp.status_code == 201, resp.text
    resp = op.patch(
        env.path("Secret", WATCHED, "demo-redis-url"),
        headers=apply,
        params=params,
        content=json.dumps({**mine, "data": {"k": "dzI="}}),
    )
    assert resp.status_code == 200, resp.text
    stripped = {**mine, "metadata": {"name": "demo-redis-url", "namespace": WATCHED, "labels": {}}}
    resp = op.patch(
        env.path("Secret", WATCHED, "demo-redis-url"),
        content=json.dumps(stripped),
        headers=apply,
        params=params,
    )
    assert resp.status_code == 403, resp.text  # nor give one away
    assert op.delete(env.path("Secret", WATCHED, "demo-redis-url")).status_code == 200
    # Nothing but the operator's ServiceAccount is constrained: the admin deletes the foreign one.
    assert cp.client.delete(env.path("Secret", WATCHED, "db")).status_code == 200


def test_real_apiserver_operator_reconciles_under_the_namespaced_rbac(real_cluster, redis_url):
    """The real operator with `--namespace team-a`, authenticated as the chart's ServiceAccount:
    it renders a ModelDeployment's children (Secrets included, through the write guard) in the
    watched namespace without a single refused request, and never sees the unwatched one."""
    from kvmesh.operator.apply import Connection
    from kvmesh.operator.memo import OperatorConfig

    cp, env = real_cluster.cp, real_cluster.env
    resp = cp.apply(crd.crd_manifest())  # = manifests/crd.yaml and the chart's crds/ (tested above)
    assert resp.status_code < 300, resp.text
    env.wait_for(
        lambda: any(
            c["type"] == "Established" and c["status"] == "True"
            for c in (cp.get("CustomResourceDefinition", None, crd.CRD_NAME) or {})
            .get("status", {})
            .get("conditions", [])
        ),
        timeout=30,
        message="CRD Established",
    )

    def body(ns):
        return {
            "apiVersion": crd.API_VERSION,
            "kind": crd.KIND,
            "metadata": {"name": "demo", "namespace": ns},
            "spec": {"model": {"builtin": crd.DEFAULT_MODEL}},
        }

    outside = cp.client.post(env.path(crd.KIND, UNWATCHED), json=body(UNWATCHED))
    assert outside.status_code == 201, outside.text
    op = real_cluster.client
    assert (
        op.get(env.path(crd.KIND, WATCHED)).status_code == 200
        and op.get(env.path(crd.KIND)).status_code == 403
    )
    config = OperatorConfig(
        connection=Connection(server=cp.server, token=real_cluster.token, ca_path=cp.ca_path),
        status_interval=1.0,
        managed_redis_url=redis_url,
        api_retries=3,
        rejected_retry_delay=5.0,
    )
    with env.LogCapture("kopf", "kvmesh") as logs:
        runner = env.OperatorThread(config, namespaces=[WATCHED])
        runner.start()
        try:
            created = cp.client.post(env.path(crd.KIND, WATCHED), json=body(WATCHED))
            assert created.status_code == 201, created.text
            md = created.json()
            spec = specs.apply_defaults(dict(md["spec"]))
            wanted = [(c["kind"], c["metadata"]["name"]) for c in render.render_children(md, spec)]
            if hasattr(render, "generated_secret_names"):
                wanted += [("Secret", n) for n in render.generated_secret_names("demo", spec)]
            assert ("Secret", "demo-redis-url") in wanted or any(k == "Secret" for k, _ in wanted)

            def children():
                missing = [(k, n) for k, n in wanted if cp.get(k, WATCHED, n) is None]
                assert not missing, f"children not created: {missing}"
                return True

            env.wait_for(children, timeout=30, interval=0.2)
            env.wait_for(
                lambda: (
                    (cp.get(crd.KIND, WATCHED, "demo") or {}).get("status", {}).get("conditions")
                ),
                timeout=20,
                interval=0.2,
                message="status written",
            )
        finally:
            runner.stop()
    refused = [m for m in logs.messages(logging.WARNING) if "403" in m or "forbidden" in m.lower()]
    assert not refused, "\n".join(refused[:5])
    # The unwatched namespace: no finalizer, no status, no children.
    untouched = cp.get(crd.KIND, UNWATCHED, "demo")
    assert not untouched["metadata"].get("finalizers") and not untouched.get("status")
    assert cp.list("Deployment", UNWATCHED) == [] and cp.list("Secret", UNWATCHED) == []
