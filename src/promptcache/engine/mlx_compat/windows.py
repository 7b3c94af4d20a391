"""Sliding windows: which tokens mlx-lm's ``RotatingKVCache`` has dropped, or will."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlx_lm.models.cache import RotatingKVCache

from .batch_caches import cache_leaves


def _window_held(c: RotatingKVCache) -> int:
    """How many tokens a sliding window holds now (its ``keep`` tokens included)."""
    keys, _, offset, _keep, _max_size, idx = c.state
    if keys is None:
        return 0
    length = int(keys.shape[2])
    return length if idx == length or idx < offset else int(idx)


def window_floor(caches: Sequence[Any]) -> int:
    """The first token past ``keep`` that every sliding window still holds (0: none dropped)."""
    return max((_floor_now(c) for c in cache_leaves(caches) if isinstance(c, RotatingKVCache)),
               default=0)


def _floor_now(c: RotatingKVCache) -> int:
    held, offset = _window_held(c), int(c.offset)
    return offset - held + int(c.keep) if held < offset else 0


def window_floor_after(caches: Sequence[Any], n_new: int) -> int:
    """``window_floor`` after ONE forward of ``n_new`` tokens (mlx-lm 0.32: one token writes in
    place, several concatenate)."""
    if n_new < 1:
        raise ValueError(f"n_new must be >= 1, got {n_new}")
    floor = 0
    for c in cache_leaves(caches):
        if not isinstance(c, RotatingKVCache):
            continue
        keep, size, offset = int(c.keep), int(c.max_size), int(c.offset)
        if n_new == 1:
            lo = offset + 1 - (size - keep) if offset + 1 > size else 0
        else:
            lo = _floor_now(c)
            if _window_held(c) >= size:  # the concatenation trims the window first
                lo = max(lo, offset - (size - 1 - keep))
        if lo > keep:
            floor = max(floor, lo)
    return floor
