"""API keys (kept only as SHA-256 hashes) and per-key rate limits (token buckets)."""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class KeyInfo:
    key_id: str  # first 12 hex digits of the hash: safe to log
    name: str
    rpm: float | None = None  # None: the router's default
    tpm: float | None = None


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def parse_keys(text: str) -> dict[str, KeyInfo]:
    """Lines of `KEY [name=N] [rpm=N] [tpm=N]`; KEY may be `sha256:<hex>` (already hashed).
    Commas also separate entries (an environment variable holding `k1,k2`). `#` starts a comment."""
    keys: dict[str, KeyInfo] = {}
    for raw_line in text.replace(",", "\n").splitlines():
        line = raw_line.split("#", 1)[0].strip()
        if not line:
            continue
        first, *opts = line.split()
        digest = first[7:].lower() if first.startswith("sha256:") else hash_key(first)
        info = KeyInfo(key_id=digest[:12], name=digest[:12])
        for opt in opts:
            k, _, v = opt.partition("=")
            if k == "name":
                info.name = v
            elif k in ("rpm", "tpm"):
                setattr(info, k, float(v))
        keys[digest] = info
    return keys


def load_keys(path: str | None, env_value: str | None = None) -> dict[str, KeyInfo] | None:
    """Keys from --api-keys-file, else from KVMESH_API_KEYS (a file path, or the keys themselves).
    None means authentication is off."""
    if path:
        return parse_keys(Path(path).read_text())
    value = os.environ.get("KVMESH_API_KEYS") if env_value is None else env_value
    if not value:
        return None
    if os.path.isfile(value):
        return parse_keys(Path(value).read_text())
    return parse_keys(value)


class ApiKeys:
    def __init__(self, keys: dict[str, KeyInfo] | None):
        self.keys = keys

    @property
    def enabled(self) -> bool:
        return self.keys is not None

    def check(self, authorization: str | None) -> KeyInfo | None:
        if not authorization or not authorization.startswith("Bearer "):
            return None
        digest = hash_key(authorization[7:].strip())
        info = self.keys.get(digest) if self.keys else None
        # constant-time compare of the digest we found (the dict lookup itself is on a hash)
        if info is not None and hmac.compare_digest(digest[:12], info.key_id):
            return info
        return None


class TokenBucket:
    __slots__ = ("capacity", "rate", "tokens", "stamp")

    def __init__(self, per_minute: float):
        self.capacity = per_minute
        self.rate = per_minute / 60.0
        self.tokens = per_minute
        self.stamp = time.monotonic()

    def _refill(self, now: float) -> None:
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until `amount` is available (0 if it is now)."""
        self._refill(now)
        amount = min(amount, self.capacity)  # a request larger than a minute's budget waits for a full bucket
        if self.tokens >= amount:
            return 0.0
        return (amount - self.tokens) / self.rate

    def take(self, amount: float) -> None:
        self.tokens -= amount


class RateLimiter:
    """Requests-per-minute and tokens-per-minute per client (API key id, or client address)."""

    def __init__(self, rpm: float | None = None, tpm: float | None = None):
        self.rpm = rpm or None
        self.tpm = tpm or None
        self._buckets: dict[tuple[str, str], TokenBucket] = {}

    def _bucket(self, client: str, kind: str, limit: float | None) -> TokenBucket | None:
        if not limit:
            return None
        b = self._buckets.get((client, kind))
        if b is None or b.capacity != limit:
            b = self._buckets[(client, kind)] = TokenBucket(limit)
        return b

    def admit(self, client: str, tokens: int = 0, rpm: float | None = None, tpm: float | None = None,
              ) -> tuple[bool, int, str]:
        """Check and charge one request of `tokens`. Returns (ok, retry_after_seconds, which_limit)."""
        now = time.monotonic()
        rb = self._bucket(client, "rpm", rpm if rpm is not None else self.rpm)
        tb = self._bucket(client, "tpm", tpm if tpm is not None else self.tpm)
        if rb is not None:
            w = rb.wait_for(1, now)
            if w > 0:
                return False, max(1, math.ceil(w)), "requests"
        if tb is not None and tokens:
            w = tb.wait_for(tokens, now)
            if w > 0:
                return False, max(1, math.ceil(w)), "tokens"
        if rb is not None:
            rb.take(1)
        if tb is not None and tokens:
            tb.take(tokens)
        return True, 0, ""

    def adjust(self, client: str, delta_tokens: int, tpm: float | None = None) -> None:
        """Charge (or refund) tokens once the real usage is known."""
        tb = self._bucket(client, "tpm", tpm if tpm is not None else self.tpm)
        if tb is not None and delta_tokens:
            tb.take(delta_tokens)
