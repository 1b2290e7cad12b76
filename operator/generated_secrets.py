"""The credentials the operator generates (random tokens in Secrets it creates once, never overwrites)."""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

from kvmesh.operator import render
from kvmesh.operator.apply import ApiError, object_path
from kvmesh.operator.memo import Memo


async def ensure_generated_secrets(
    memo: Memo, md: dict[str, Any], spec: dict[str, Any]
) -> str | None:
    """Create the generated credentials that do not exist yet (a random token each; an
    existing Secret is never overwritten). Returns a digest of their identities, which the
    pod templates carry, so a Secret made anew rolls every pod that uses it."""
    assert memo.client is not None
    meta = md["metadata"]
    uids = []
    for name in render.generated_secret_names(meta["name"], spec):
        secret = await memo.client.get("Secret", meta["namespace"], name)
        if secret is None:
            body = render.generated_secret(md, spec, name, secrets.token_hex(24))
            try:  # create, never apply: an existing token must not be replaced
                secret = await memo.client.request(
                    "POST",
                    object_path("Secret", meta["namespace"]),
                    body=body,
                    retry_conflicts=False,
                )
            except ApiError as exc:
                if exc.status != 409:
                    raise
                secret = await memo.client.get(
                    "Secret", meta["namespace"], name
                )  # a concurrent reconcile won
                if secret is None:
                    raise
        uids.append(f"{name}={secret['metadata']['uid']}")
    return hashlib.sha256(",".join(uids).encode()).hexdigest()[:16] if uids else None
