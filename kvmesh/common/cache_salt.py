"""What a request's ``cache_salt`` may be: the one check the router and the engine both apply.

The salt goes into the root of the block-key chain (``block_keys.root_key``), so it must be
text that encodes to UTF-8; a lone surrogate ("\\ud800" in JSON) cannot. Both components
refuse a bad salt with the same 400 naming ``cache_salt``: the router before it computes
block keys, the engine before it admits the request.
"""

from __future__ import annotations

MAX_CACHE_SALT_CHARS = 1024  # a tenant id or a random 256-bit token is far shorter


class InvalidCacheSalt(ValueError):
    """A ``cache_salt`` that is refused; ``code`` is the OpenAI error code (or None)."""

    param = "cache_salt"

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


def check_cache_salt(value: object) -> str | None:
    """``value`` if it is a valid salt (None: no salt), else raise InvalidCacheSalt."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidCacheSalt(f"cache_salt must be a string, got {type(value).__name__}")
    if not value:
        raise InvalidCacheSalt("cache_salt must be a non-empty string")
    if len(value) > MAX_CACHE_SALT_CHARS:
        raise InvalidCacheSalt(
            f"cache_salt is {len(value)} characters long; at most "
            f"{MAX_CACHE_SALT_CHARS} are allowed"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidCacheSalt(
            "cache_salt is not valid Unicode text (a lone surrogate such as \\ud800)",
            code="invalid_text",
        ) from None
    return value
