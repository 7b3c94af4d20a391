"""A model's KV bytes per request: a 1-token probe and the bytes at ``n`` tokens."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from . import adapters

KV_GROWTH_STEP = 256  # mlx-lm's KV caches grow in steps of this many tokens


def probe_caches(model: Any) -> list[Any]:
    """Fresh cache objects after a forward of one token (token id 0)."""
    caches = list(make_prompt_cache(model))
    mx.eval(model(mx.array([[0]]), cache=caches))
    return caches



def kv_row_bytes(model: Any, probed: Sequence[Any] | None = None) -> Callable[[int], int]:
    """An upper bound of a request's cache bytes at ``n`` tokens (KV + a growth step)."""
    caches = list(probed) if probed is not None else probe_caches(model)
    per_token = 0
    windows: list[tuple[int, int]] = []  # (bytes per token, window)
    fixed = 0
    for c in caches:
        leaves = list(getattr(c, "caches", [c]))
        for leaf in leaves:
            if isinstance(leaf, ArraysCache):
                fixed += sum(int(a.nbytes) for a in leaf.cache if a is not None)
                continue
            arrays = [a for _, a in adapters.state_arrays([leaf])]
            if not arrays:
                continue
            length = max(int(a.shape[2]) for a in arrays if a.ndim == 4)
            per = sum(int(a.nbytes) for a in arrays) // max(1, length)
            window = getattr(leaf, "max_size", None)
            if isinstance(window, int) and window > 0:
                windows.append((per, window))
            else:
                per_token += per

    def row_bytes(n: int) -> int:
        room = n + KV_GROWTH_STEP
        return per_token * room + sum(p * min(room, w) for p, w in windows) + fixed

    return row_bytes

