import numpy as np
import pytest

from promptcache.hashing import (
    CACHE_FORMAT_VERSION,
    chain_hashes,
    hash_block,
    namespace_root,
    validate_tokens,
)
from promptcache.meta import ExtraKeySpan, Namespace, extra_keys_for


def test_root_is_pinned_across_processes_and_machines():
    root = namespace_root(model_fingerprint="m1", block_size=64, kv_spec="float32", tenant="default")
    assert CACHE_FORMAT_VERSION == 2
    assert root.hex() == GOLDEN_ROOT
    assert hash_block(root, [1, 2, 3]).hex() == GOLDEN_BLOCK
    # the roots of format version 1 are unchanged: only the version part differs
    v1 = namespace_root(model_fingerprint="m1", block_size=64, kv_spec="float32", tenant="default",
                        format_version=1)
    assert v1.hex() == GOLDEN_ROOT_V1


GOLDEN_ROOT = "0509cd997b38543a03e3b8f74f4a29feae5dd7fb7816ff19462079828e1b65d3"
GOLDEN_BLOCK = "456d1986acc09aca0c260eda3613a8d0505129505a51126732d73e3c63e5fa8b"
GOLDEN_ROOT_V1 = "6588eeea87087c89b8cfb966e1463d53587ae31d4273b0d9c204cabad3c927cb"


def test_chain_changes_with_every_input():
    ns = Namespace("m1", 4)
    base = hash_block(ns.root, [1, 2, 3, 4])
    assert hash_block(ns.root, [1, 2, 3, 5]) != base
    assert hash_block(ns.root, [1, 2, 3, 4], (b"img",)) != base
    assert hash_block(Namespace("m1", 4, tenant="other").root, [1, 2, 3, 4]) != base
    assert hash_block(Namespace("m2", 4).root, [1, 2, 3, 4]) != base
    assert hash_block(Namespace("m1", 8).root, [1, 2, 3, 4]) != base
    assert hash_block(Namespace("m1", 4, kv_spec="q8").root, [1, 2, 3, 4]) != base
    assert len(base) == 32


def test_chain_hashes_only_full_blocks_and_chain():
    ns = Namespace("m", 2)
    hs = chain_hashes(ns.root, [1, 2, 3, 4, 5], 2)
    assert len(hs) == 2
    assert hs[0] == hash_block(ns.root, [1, 2])
    assert hs[1] == hash_block(hs[0], [3, 4])


def test_extra_keys_apply_to_overlapping_blocks():
    spans = [ExtraKeySpan(3, 6, b"a"), ExtraKeySpan(9, 10, b"b")]
    assert extra_keys_for(spans, 0, 4) == (b"a",)
    assert extra_keys_for(spans, 4, 8) == (b"a",)
    assert extra_keys_for(spans, 6, 9) == ()
    assert extra_keys_for(spans, 8, 12) == (b"b",)


@pytest.mark.parametrize(
    "bad,msg",
    [
        ([], "empty"),
        ([1, -2], "out of range"),
        ([1, 2.0], "not an integer"),
        ([True], "not an integer"),
        ("abc", "string"),
        (np.array([1.0, 2.0]), "integer dtype"),
        (np.zeros((2, 2), dtype=np.int32), "1-D"),
        ([2**32], "out of range"),
        (5, "sequence"),
    ],
)
def test_validate_tokens_rejects_bad_input(bad, msg):
    with pytest.raises(ValueError, match=msg):
        validate_tokens(bad)


def test_validate_tokens_accepts_numpy_and_lists():
    assert validate_tokens(np.array([1, 2], dtype=np.int64)) == (1, 2)
    assert validate_tokens([np.int32(3), 4]) == (3, 4)


def test_namespace_rejects_bad_tenant():
    with pytest.raises(ValueError, match="tenant"):
        Namespace("m", 4, tenant="../etc")
