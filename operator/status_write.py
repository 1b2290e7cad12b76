"""A ModelDeployment's status: derived from its children and merge-patched into the API."""

from __future__ import annotations

from typing import Any

from kvmesh.operator import crd, render
from kvmesh.operator import spec as specs
from kvmesh.operator import status as st
from kvmesh.operator.memo import Memo


async def write_status(memo: Memo, md: dict[str, Any], patch: dict[str, Any]) -> None:
    """Merge-patch the ModelDeployment's status subresource."""
    meta = md["metadata"]
    assert memo.client is not None
    await memo.client.patch_status(crd.KIND, meta["namespace"], meta["name"], patch)


async def refresh_status(
    memo: Memo,
    md: dict[str, Any],
    spec: dict[str, Any],
    *,
    observed: bool = False,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Derive status from the children and write it."""
    assert memo.client is not None
    meta = md["metadata"]
    ns, name = meta["namespace"], meta["name"]
    n = render.names(name)
    engine = await memo.client.get("Deployment", ns, n[render.ENGINE])
    router = (
        await memo.client.get("Deployment", ns, n[render.ROUTER])
        if spec["router"]["replicas"] > 0
        else None
    )
    redis = (
        await memo.client.get("Deployment", ns, n[render.REDIS])
        if spec["redis"]["mode"] == "managed"
        else None
    )
    e = st.deployment_summary(engine)
    old = md.get("status") or {}
    gen = (
        meta.get("generation")
        if observed
        else old.get("observedGeneration", meta.get("generation"))
    )
    patch: dict[str, Any] = {
        "model": specs.served_model_name(spec),
        "replicas": e["replicas"],
        "readyReplicas": e["ready"],
        "selector": render.selector_string(name),
        "routerEndpoint": render.router_endpoint(name, ns),
        "conditions": st.derive_conditions(
            generation=gen,
            previous=old.get("conditions"),
            now=st.now_iso(),
            engine=e,
            router=st.deployment_summary(router) if spec["router"]["replicas"] > 0 else None,
            redis=st.deployment_summary(redis) if spec["redis"]["mode"] == "managed" else None,
        ),
    }
    sticky = [
        c
        for c in old.get("conditions") or []
        if c.get("type") == "Ready"
        and c.get("reason") in ("ApplyFailed", "InvalidSpec")
        and c.get("observedGeneration") == meta.get("generation")
    ]
    if sticky and not observed:
        del patch["conditions"]  # only a successful reconcile of this generation clears these
    patch["desiredReplicas"] = render.engine_replicas(spec)
    if "conditions" in patch:
        message = memo.shared.conflicts.get(meta["uid"], "")
        patch["conditions"].append(
            st.condition(
                st.CONFLICT,
                bool(message),
                "FieldManagedElsewhere" if message else "NoConflict",
                message or "the operator owns every field it renders",
                gen,
                old.get("conditions"),
                st.now_iso(),
            )
        )
    if observed:
        patch["observedGeneration"] = gen
    patch.update(extra or {})
    await write_status(memo, md, patch)
    return patch
