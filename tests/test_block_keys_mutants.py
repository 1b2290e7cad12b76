"""Contract 1, edges that mutation testing found unpinned (see docs/mutation.md)."""

import pytest

from kvmesh.common.block_keys import block_key, block_keys, root_key


@pytest.mark.parametrize("bs", [0, -1, -16])
def test_a_block_size_below_one_is_refused_by_name(bs):
    # The message names the parameter: a zero step left to range() would fail with another one.
    with pytest.raises(ValueError, match=rf"block_size must be positive, got {bs}"):
        block_keys([1, 2, 3], "m", block_size=bs)


def test_a_block_size_of_one_gives_one_key_per_token():
    keys = block_keys([7, 8, 9], "m", block_size=1)
    root = root_key("m")
    first = block_key(root, [7])
    assert keys == [first, block_key(first, [8]), block_key(block_key(first, [8]), [9])]
