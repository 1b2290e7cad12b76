"""API keys (kept only as SHA-256 hashes) and per-key rate limits (token buckets)."""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class KeyInfo:
    key_id: str  # first 12 hex digits of the hash: safe to log
    name: str
    rpm: float | None = None  # None: the router's default
    tpm: float | None = None
    band: str | None = None  # flow control: the key's priority band (None: the default band)
    weight: float | None = None  # flow control: its fair-share weight (None: its band's)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyFileError(ValueError):
    """A key file that is missing, unreadable or malformed: a startup error."""


_LINE = re.compile(r"^(.*?)((?:\s+(?:name|rpm|tpm|band|weight)=\S*)*)\s*$")


def _parse_line(line: str, where: str) -> tuple[str, KeyInfo]:
    """`KEY [name=N] [rpm=N] [tpm=N] [band=B] [weight=W]`: the options are recognised only at the end of the line;
    everything before them is the key, whatever characters it holds (`#`, `,`, spaces)."""
    m = _LINE.match(line)
    key, opts = m.group(1).strip(), m.group(2).split()
    digest = key[7:].lower() if key.startswith("sha256:") else hash_key(key)
    if key.startswith("sha256:") and (
        len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest)
    ):
        raise KeyFileError(f"{where}: sha256: must be followed by 64 hex digits")
    info = KeyInfo(key_id=digest[:12], name=digest[:12])
    for opt in opts:
        k, _, v = opt.partition("=")
        if k in ("name", "band"):
            setattr(info, k, v)
        else:
            try:
                value = float(v)
            except ValueError:
                raise KeyFileError(f"{where}: {k}={v!r} is not a number") from None
            if not (value > 0 and math.isfinite(value)):
                raise KeyFileError(f"{where}: {k} must be a positive number, got {v!r}")
            setattr(info, k, value)
    return digest, info


def parse_keys(text: str, source: str = "keys", commas: bool = False) -> dict[str, KeyInfo]:
    """One key per line: `KEY [name=N] [rpm=N] [tpm=N] [band=B] [weight=W]`; KEY may be `sha256:<hex>` (already hashed).
    A line is the whole key (a `#` or `,` inside a key is part of it); a line whose first
    non-blank character is `#` is a comment. With `commas` (the KVMESH_API_KEYS variable holding
    the keys themselves, `k1,k2`), commas also separate entries."""
    keys: dict[str, KeyInfo] = {}
    lines = text.replace(",", "\n").splitlines() if commas else text.splitlines()
    for n, raw_line in enumerate(lines, 1):
        line = raw_line.strip()
        if not line or line.startswith("#"):
            continue
        digest, info = _parse_line(line, f"{source} line {n}")
        keys[digest] = info
    return keys


def _read_key_file(path: str) -> dict[str, KeyInfo]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise KeyFileError(f"API key file {path}: {exc.strerror or exc}") from None
    return parse_keys(text, path)


def _looks_like_path(value: str) -> bool:
    return value.startswith(("/", "./", "../", "~")) and "\n" not in value and "," not in value


def load_keys(path: str | None, env_value: str | None = None) -> dict[str, KeyInfo] | None:
    """Keys from --api-keys-file, else from KVMESH_API_KEYS (a file path, or the keys themselves).
    None means authentication is off. A key file that does not exist (or a KVMESH_API_KEYS that
    names one) is an error, never a key."""
    if path:
        return _read_key_file(path)
    value = os.environ.get("KVMESH_API_KEYS") if env_value is None else env_value
    if not value or not value.strip():
        return None
    value = value.strip()
    if os.path.isfile(value) or _looks_like_path(value):
        return _read_key_file(os.path.expanduser(value))
    return parse_keys(value, "KVMESH_API_KEYS", commas=True)


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
    """A bucket of `per_minute` tokens, refilled continuously. It never holds less than zero nor
    more than a minute's worth, so nothing charged to it can lock a client out for longer than
    the one-minute window."""

    __slots__ = ("capacity", "rate", "tokens", "stamp")

    def __init__(self, per_minute: float):
        self.capacity = per_minute
        self.rate = per_minute / 60.0
        self.tokens = per_minute
        self.stamp = time.monotonic()

    def _refill(self, now: float) -> None:
        if now > self.stamp:  # (a `now` read before the bucket was made must not drain it)
            self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until `amount` is available (0 if it is now)."""
        self._refill(now)
        amount = min(
            amount, self.capacity
        )  # a request larger than a minute's budget waits for a full bucket
        if self.tokens >= amount:
            return 0.0
        return (amount - self.tokens) / self.rate

    def take(self, amount: float) -> float:
        """Charge `amount` (a negative amount refunds); returns what was charged."""
        self._refill(time.monotonic())
        before = self.tokens
        self.tokens = min(self.capacity, max(0.0, self.tokens - amount))
        return before - self.tokens

    def full(self, now: float) -> bool:
        return self.tokens + (now - self.stamp) * self.rate >= self.capacity


class RateLimiter:
    """Requests-per-minute and tokens-per-minute per client (API key id, or client address).

    A request is charged a bounded estimate at admission (at most one minute's budget) and
    settled later: refunded when the engine refuses it, corrected with the usage it reports."""

    MAX_CLIENTS = 10_000  # buckets kept before full (idle) ones are dropped

    def __init__(self, rpm: float | None = None, tpm: float | None = None):
        self.rpm = rpm or None
        self.tpm = tpm or None
        self._buckets: dict[tuple[str, str], TokenBucket] = {}

    def _bucket(self, client: str, kind: str, limit: float | None) -> TokenBucket | None:
        if not limit:
            return None
        b = self._buckets.get((client, kind))
        if b is None or b.capacity != limit:
            if len(self._buckets) >= self.MAX_CLIENTS:
                self._prune()
            b = self._buckets[(client, kind)] = TokenBucket(limit)
        return b

    def _prune(self) -> None:
        now = time.monotonic()
        for k in [k for k, b in self._buckets.items() if b.full(now)]:
            del self._buckets[k]

    def admit(
        self,
        client: str,
        tokens: int = 0,
        rpm: float | None = None,
        tpm: float | None = None,
    ) -> tuple[bool, int, str]:
        """Check and charge one request of `tokens`. Returns (ok, retry_after_seconds, which_limit)."""
        ok, retry, which, _ = self.admit_charge(client, tokens, rpm, tpm)
        return ok, retry, which

    def admit_charge(
        self,
        client: str,
        tokens: int = 0,
        rpm: float | None = None,
        tpm: float | None = None,
    ) -> tuple[bool, int, str, int]:
        """admit(), also returning the tokens charged (the estimate, capped at one minute's budget)."""
        tokens = max(0, int(tokens))
        rb = self._bucket(client, "rpm", rpm if rpm is not None else self.rpm)
        tb = self._bucket(client, "tpm", tpm if tpm is not None else self.tpm)
        now = time.monotonic()
        if rb is not None:
            w = rb.wait_for(1, now)
            if w > 0:
                return False, max(1, math.ceil(w)), "requests", 0
        if tb is not None and tokens:
            w = tb.wait_for(tokens, now)
            if w > 0:
                return False, max(1, math.ceil(w)), "tokens", 0
        if rb is not None:
            rb.take(1)
        charged = 0
        if tb is not None and tokens:
            charged = round(tb.take(min(tokens, tb.capacity)))
        return True, 0, "", charged

    def adjust(self, client: str, delta_tokens: int, tpm: float | None = None) -> int:
        """Charge (or refund, if negative) tokens once the real usage is known; returns the change
        actually made (the bucket stays within [0, one minute's budget])."""
        tb = self._bucket(client, "tpm", tpm if tpm is not None else self.tpm)
        if tb is not None and delta_tokens:
            return int(round(tb.take(delta_tokens)))
        return 0
