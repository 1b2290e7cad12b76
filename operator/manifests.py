"""Install manifests as data: least-privilege RBAC, the operator Deployment, an example.

``python -m kvmesh.operator.generate`` writes them (and the CRD) into ``manifests/``
and the Helm chart; tests check the files are up to date and valid.
"""

from __future__ import annotations

from typing import Any

from kvmesh.operator import crd
from kvmesh.operator.render import OPERATOR_POD_LABELS, VERSION

NAMESPACE = "kvmesh-system"
NAME = "kvmesh-operator"
OPERATOR_IMAGE = f"ghcr.io/kvmesh/operator:{VERSION}"
LIVENESS_PORT = 8080

# Exactly what the operator calls (operator/apply.py, handlers.py, and kopf itself):
# - modeldeployments: kopf lists/watches, patches annotations & finalizers; we GET fresh copies.
# - status: kopf and status_write.py merge-patch it.
# - children: server-side apply = PATCH, plus CREATE when the object is new; GET for status;
#   LIST + DELETE to prune children no longer rendered; secrets GET for an external Redis URL.
# - pods: the autoscaler (scaling.py) lists the engine pods (readiness, startup deadline) and
#   patches their pod-deletion-cost annotation before a scale-down.
# - events: kopf posts core/v1 Events (create).
# tests/operator/test_operator_runtime.py checks that the operator uses all of these and no more.
# Not needed: namespaces and CRDs (kopf scanning is disabled), peering (standalone).
RBAC_RULES: list[dict[str, Any]] = [
    {
        "apiGroups": [crd.GROUP],
        "resources": [crd.PLURAL],
        "verbs": ["get", "list", "watch", "patch"],
    },
    {"apiGroups": [crd.GROUP], "resources": [f"{crd.PLURAL}/status"], "verbs": ["patch"]},
    {"apiGroups": [crd.GROUP], "resources": [f"{crd.PLURAL}/scale"], "verbs": ["patch"]},
    # Children: watched (label-selected) so drift is healed within seconds.
    {
        "apiGroups": ["apps"],
        "resources": ["deployments"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    {
        "apiGroups": [""],
        "resources": ["secrets"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    {  # the adapter list engines read at start
        "apiGroups": [""],
        "resources": ["configmaps"],
        "verbs": ["list", "watch", "create", "patch", "delete"],
    },
    {
        "apiGroups": [""],
        "resources": ["services"],
        "verbs": ["list", "watch", "create", "patch", "delete"],
    },
    {
        "apiGroups": ["networking.k8s.io"],
        "resources": ["networkpolicies"],
        "verbs": ["list", "watch", "create", "patch", "delete"],
    },
    {
        "apiGroups": ["policy"],
        "resources": ["poddisruptionbudgets"],
        "verbs": ["list", "watch", "create", "patch", "delete"],
    },
    {
        "apiGroups": [""],
        "resources": ["persistentvolumeclaims"],
        "verbs": ["list", "watch", "create", "patch", "delete"],
    },
    {
        "apiGroups": ["batch"],
        "resources": ["jobs"],
        "verbs": ["list", "watch", "create", "patch", "delete"],
    },
    # The router's own identity (ServiceAccount + Role + RoleBinding per ModelDeployment).
    # Always rendered, so never pruned: no delete (the garbage collector removes them with their owner).
    {
        "apiGroups": [""],
        "resources": ["serviceaccounts"],
        "verbs": ["list", "watch", "create", "patch"],
    },
    {
        "apiGroups": ["rbac.authorization.k8s.io"],
        "resources": ["roles", "rolebindings"],
        "verbs": ["list", "watch", "create", "patch"],
    },
    # Held only so the operator may grant it to routers (RBAC forbids granting more than one holds).
    {
        "apiGroups": ["discovery.k8s.io"],
        "resources": ["endpointslices"],
        "verbs": ["get", "list", "watch"],
    },
    # The autoscaler: engine pods (readiness, startup deadline) and their deletion cost.
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "patch"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
]

_LABELS = dict(OPERATOR_POD_LABELS)  # the managed Redis' NetworkPolicy admits pods labelled so


def rbac(namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": NAME, "namespace": namespace, "labels": _LABELS},
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": NAME, "labels": _LABELS},
            "rules": RBAC_RULES,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": NAME, "labels": _LABELS},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": NAME,
            },
            "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": namespace}],
        },
    ]


# Resources a Role cannot grant (cluster-scoped). RBAC_RULES must not need any of them, or the
# namespace-scoped install (one Role per watched namespace) would silently lack a permission.
CLUSTER_SCOPED_RESOURCES = frozenset(
    {
        "namespaces",
        "nodes",
        "persistentvolumes",
        "customresourcedefinitions",
        "clusterroles",
        "clusterrolebindings",
        "storageclasses",
        "priorityclasses",
        "runtimeclasses",
        "ingressclasses",
        "volumeattachments",
        "csidrivers",
        "csinodes",
        "apiservices",
        "certificatesigningrequests",
        "validatingwebhookconfigurations",
        "mutatingwebhookconfigurations",
        "validatingadmissionpolicies",
        "validatingadmissionpolicybindings",
        "tokenreviews",
        "subjectaccessreviews",
    }
)


def namespaced_rbac(
    watch_namespaces: list[str], namespace: str = NAMESPACE
) -> list[dict[str, Any]]:
    """Namespace-scoped install (``kvmesh operator --namespace NS ...``): the ServiceAccount in
    ``namespace`` and RBAC_RULES as a Role + RoleBinding in each watched namespace, instead of
    the ClusterRole/Binding of :func:`rbac`. The chart renders the same with ``watchNamespaces``."""
    if not watch_namespaces:
        raise ValueError("a namespace-scoped install needs at least one watched namespace")
    cluster = sorted(
        {
            r
            for rule in RBAC_RULES
            for r in rule["resources"]
            if r.split("/")[0] in CLUSTER_SCOPED_RESOURCES
        }
    )
    if cluster:
        raise ValueError(
            f"RBAC_RULES grant cluster-scoped {cluster}: a Role cannot; keep a ClusterRole for them"
        )
    out: list[dict[str, Any]] = [rbac(namespace)[0]]
    for ns in watch_namespaces:
        out += [
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "Role",
                "metadata": {"name": NAME, "namespace": ns, "labels": _LABELS},
                "rules": RBAC_RULES,
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": NAME, "namespace": ns, "labels": _LABELS},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": NAME},
                "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": namespace}],
            },
        ]
    return out


def operator_deployment(
    namespace: str = NAMESPACE, image: str = OPERATOR_IMAGE
) -> list[dict[str, Any]]:
    return [
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {
                "name": namespace,
                "labels": {"pod-security.kubernetes.io/enforce": "restricted"},
            },
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": NAME, "namespace": namespace, "labels": _LABELS},
            "spec": {
                "replicas": 1,
                "strategy": {"type": "Recreate"},  # one operator at a time (kopf runs standalone)
                "selector": {"matchLabels": _LABELS},
                "template": {
                    "metadata": {"labels": _LABELS},
                    "spec": {
                        "serviceAccountName": NAME,
                        "securityContext": {
                            "runAsNonRoot": True,
                            "runAsUser": 10001,
                            "runAsGroup": 10001,
                            "seccompProfile": {"type": "RuntimeDefault"},
                        },
                        "containers": [
                            {
                                "name": "operator",
                                "image": image,
                                "imagePullPolicy": "IfNotPresent",
                                "command": [
                                    "kvmesh",
                                    "operator",
                                    "--liveness-port",
                                    str(LIVENESS_PORT),
                                ],
                                "ports": [
                                    {
                                        "name": "health",
                                        "containerPort": LIVENESS_PORT,
                                        "protocol": "TCP",
                                    }
                                ],
                                "livenessProbe": {
                                    "httpGet": {"path": "/healthz", "port": "health"},
                                    "initialDelaySeconds": 10,
                                    "periodSeconds": 15,
                                },
                                "resources": {
                                    "requests": {"cpu": "50m", "memory": "128Mi"},
                                    "limits": {"memory": "512Mi"},
                                },
                                "securityContext": {
                                    "allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True,
                                    "runAsNonRoot": True,
                                    "capabilities": {"drop": ["ALL"]},
                                },
                            }
                        ],
                    },
                },
            },
        },
    ]


def example_modeldeployment() -> dict[str, Any]:
    return {
        "apiVersion": crd.API_VERSION,
        "kind": crd.KIND,
        "metadata": {"name": "smollm2", "namespace": "default"},
        "spec": {
            "model": {"builtin": crd.DEFAULT_MODEL},
            "engine": {
                "resources": {
                    "requests": {"cpu": "2", "memory": "4Gi"},
                    "limits": {"memory": "8Gi", "nvidia.com/gpu": 1},
                }
            },
            "autoscaling": {
                "minReplicas": 1,
                "maxReplicas": 4,
                "targetKVUtilization": 0.7,
                "scaleUpStabilizationSeconds": 0,
                "scaleDownStabilizationSeconds": 300,
                "maxScaleDownStep": 1,
            },
            "router": {"replicas": 2, "policy": "prefix"},
            "redis": {"mode": "managed"},
        },
    }
