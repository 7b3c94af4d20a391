"""BoundedLRU: the one bounded least-recently-used map (promptcache/lru.py)."""

from __future__ import annotations

import pytest

from promptcache.lru import BoundedLRU


def test_put_evicts_the_least_recently_used_and_says_what() -> None:
    lru: BoundedLRU[str, int] = BoundedLRU(2)
    assert lru.put("a", 1) == [] and lru.put("b", 2) == []
    assert lru.get("a") == 1  # a is now the newest
    assert lru.put("c", 3) == [("b", 2)]
    assert lru.items() == [("a", 1), ("c", 3)]
    assert lru.peek("a") == 1 and lru.items() == [("a", 1), ("c", 3)]  # peek: no touch
    assert lru.put("a", 10) == [] and lru.items() == [("c", 3), ("a", 10)]
    assert (len(lru), "c" in lru, "b" in lru, list(lru)) == (2, True, False, ["c", "a"])
    assert lru.pop("c") == 3 and lru.pop("c") is None and lru.get("zz") is None
    assert lru.pop_oldest() == ("a", 10) and len(lru) == 0
    with pytest.raises(KeyError):
        lru.pop_oldest()


def test_capacity_zero_keeps_nothing_and_negative_is_refused() -> None:
    lru: BoundedLRU[int, str] = BoundedLRU(0)
    assert lru.put(1, "x") == [(1, "x")] and len(lru) == 0
    with pytest.raises(ValueError, match="capacity must be >= 0, got -1"):
        BoundedLRU(-1)
