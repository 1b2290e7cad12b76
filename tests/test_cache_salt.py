"""The one cache_salt check (kvmesh.common.cache_salt) that router and engine share: what it
accepts is passed on unchanged (the block keys of a valid salt stay as pinned in
tests/test_block_keys.py), what it refuses raises InvalidCacheSalt naming the field."""

import pytest

from kvmesh.common.block_keys import root_key
from kvmesh.common.cache_salt import MAX_CACHE_SALT_CHARS, InvalidCacheSalt, check_cache_salt
from kvmesh.common.openapi import components


@pytest.mark.parametrize(
    "salt", [None, "a", "tenant-42", "t\u00e9nant \U0001f600", "s" * MAX_CACHE_SALT_CHARS]
)
def test_valid_salts_pass_unchanged(salt):
    assert check_cache_salt(salt) is salt
    root_key("m", salt)  # and can be hashed


@pytest.mark.parametrize(
    "salt, says, code",
    [
        ("", "non-empty", None),
        (5, "must be a string, got int", None),
        (True, "must be a string, got bool", None),
        (["a"], "must be a string, got list", None),
        ({"a": 1}, "must be a string, got dict", None),
        ("s" * (MAX_CACHE_SALT_CHARS + 1), f"at most {MAX_CACHE_SALT_CHARS}", None),
        ("a\ud800", "not valid Unicode", "invalid_text"),
        ("\udfff", "not valid Unicode", "invalid_text"),
    ],
)
def test_hostile_salts_are_refused(salt, says, code):
    with pytest.raises(InvalidCacheSalt) as info:
        check_cache_salt(salt)
    assert info.value.param == "cache_salt"
    assert says in str(info.value) and info.value.code == code


def test_openapi_documents_the_bounds():
    schemas = components("m", 100, False)["schemas"]
    salts = [
        s["properties"]["cache_salt"]
        for s in schemas.values()
        if "cache_salt" in s.get("properties", {})
    ]
    assert len(salts) >= 2  # completions and chat
    for salt in salts:
        assert (salt["minLength"], salt["maxLength"]) == (1, MAX_CACHE_SALT_CHARS)
