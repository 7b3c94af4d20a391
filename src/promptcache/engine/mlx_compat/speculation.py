"""Speculative decoding's repair of batch caches after a verify forward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, BatchRotatingKVCache, dynamic_roll

from .batch_caches import RowMoves, cache_leaves, ssm_states


def speculation_kind(batch: Sequence[Any]) -> str | None:
    """How a batch takes a verify forward's rejected positions back: ``"kv"``, ``"state"`` (restore
    and refeed) or None."""
    leaves = cache_leaves(batch)
    if not leaves:
        return None
    kinds = {type(c) for c in leaves}
    if not kinds <= {BatchKVCache, BatchRotatingKVCache, ArraysCache}:
        return None
    if ArraysCache in kinds:
        return None if BatchRotatingKVCache in kinds else "state"
    return "kv"


# model types whose array-state layers honour ``ArraysCache.lengths``
# (tests/engine/test_speculation_kinds.py)
_STATES_TAKE_LENGTHS = frozenset({"qwen3_5", "qwen3_5_moe", "qwen3_next", "falcon_h1",
                                  "kimi_linear"})


def states_take_lengths(model: Any) -> bool:
    """True if ``model``'s array states can be fed right-padded rows (``prepare(lengths)``)."""
    return getattr(model, "model_type", None) in _STATES_TAKE_LENGTHS


def before_verify(batch: Sequence[Any]) -> list[list[Any]] | None:
    """Before a verify forward: windows in temporal order; the pre-verify array states or None."""
    for c in cache_leaves(batch):
        if isinstance(c, BatchRotatingKVCache) and c.keys is not None:
            c._temporal_order()
    states = ssm_states(batch)
    return states if states else None


def drop_row_tails(batch: Sequence[Any], counts: Sequence[int],
                   moves: Sequence[RowMoves] | None = None) -> None:
    """Drop the last ``counts[i]`` positions of row ``i`` after a verify forward (the rest becomes
    left padding).

    Windows have the common tail sliced off the buffer too (``trim`` leaves it in the window).
    """
    leaves = cache_leaves(batch)
    common = min(counts)
    for c in leaves:
        if common > 0:
            c.trim(common)
        if isinstance(c, BatchRotatingKVCache) and c.keys is not None \
                and c.keys.shape[2] > c._idx:
            c.keys = c.keys[..., : c._idx, :]
            c.values = c.values[..., : c._idx, :]
    rest = [n - common for n in counts]
    if not any(rest):
        return
    if moves is not None and _move_heads(leaves, rest, moves):
        return
    for c in leaves:
        if isinstance(c, BatchRotatingKVCache):
            shift = mx.array(rest)
            c.keys = dynamic_roll(c.keys, shift[:, None], axis=2)
            c.values = dynamic_roll(c.values, shift[:, None], axis=2)
            c.offset = c.offset - shift
            c.left_padding = c.left_padding + shift
        else:
            c.prepare(right_padding=rest)
            c.finalize()


def _move_heads(leaves: Sequence[Any], rest: Sequence[int], moves: Sequence[RowMoves]
                ) -> bool:
    """Move row ``i``'s first ``rest[i]`` positions into its rejected tail; False if impossible."""
    if not leaves or not all(type(c) is BatchKVCache and c.keys is not None for c in leaves):
        return False
    pads = [int(p) for p in leaves[0].left_padding.tolist()]
    end = int(leaves[0]._idx)
    if any(n and end - pads[i] < 2 * n for i, n in enumerate(rest)):
        return False
    heads = [(c, i, n, mx.array(c.keys[i : i + 1, :, pads[i] : pads[i] + n]),
              mx.array(c.values[i : i + 1, :, pads[i] : pads[i] + n]))
             for c in leaves for i, n in enumerate(rest) if n]
    # the heads are copied first, so the writes update the buffers in place
    mx.eval([h[3] for h in heads] + [h[4] for h in heads])
    for c, i, n, k, v in heads:
        c.keys[i : i + 1, :, end - n : end] = k
        c.values[i : i + 1, :, end - n : end] = v
    shift = mx.array(list(rest))
    for c in leaves:
        c.left_padding = c.left_padding + shift
        c.offset = c.offset - shift
    for i, n in enumerate(rest):
        if n:
            moves[i].moved(pads[i], end, n)
    return True


def finalize_refeed(batch: Sequence[Any], moves: Sequence[RowMoves]) -> None:
    """After a ``"state"`` refeed: arrays finalize, KV pad tails become left padding."""
    leaves = cache_leaves(batch)
    kv = [c for c in leaves if isinstance(c, BatchKVCache)]
    pads = kv[0]._right_padding if kv else None
    if pads is not None:
        moved = _move_heads(kv, [int(n) for n in pads.tolist()], moves)
        for c in kv:
            if moved:
                c._right_padding = None
            else:
                c.finalize()
    for c in leaves:
        if not isinstance(c, BatchKVCache):
            c.finalize()


def restore_before_verify(batch: Sequence[Any], states: Sequence[Sequence[Any]],
                          width: int) -> None:
    """Undo a verify forward of ``width`` on a ``"state"`` batch (states back, KV trimmed)."""
    it = iter(states)
    for c in cache_leaves(batch):
        if isinstance(c, ArraysCache):
            c.cache = list(next(it))
        else:
            c.trim(width)
