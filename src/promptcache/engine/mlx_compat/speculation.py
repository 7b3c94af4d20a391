"""Speculative decoding's repair of batch caches after a verify forward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, BatchRotatingKVCache, dynamic_roll

from .batch_caches import RowMoves, cache_leaves, ssm_states


def speculation_kind(batch: Sequence[Any]) -> str | None:
    """How a batch's caches take a verify forward's rejected positions back:

    - ``"kv"``: every leaf is a ``BatchKVCache`` or a ``BatchRotatingKVCache`` (plain
      KV, MLA, sliding windows): the rejected tail of each row is dropped
      (``drop_row_tails``);
    - ``"state"``: ``ArraysCache`` leaves (SSM / linear attention state, which absorbs
      every position fed) with ``BatchKVCache`` leaves: the states are put back as they
      were before the verify and the accepted tokens are fed again
      (``restore_before_verify`` + a right-padded forward);
    - None: anything else (quantized KV; array states next to sliding windows)."""
    leaves = cache_leaves(batch)
    if not leaves:
        return None
    kinds = {type(c) for c in leaves}
    if not kinds <= {BatchKVCache, BatchRotatingKVCache, ArraysCache}:
        return None
    if ArraysCache in kinds:
        return None if BatchRotatingKVCache in kinds else "state"
    return "kv"


# model types whose array-state layers honour ``ArraysCache.lengths`` in mlx-lm 0.32 (a
# right-padded position never reaches their conv or recurrent state). nemotron_h's
# Mamba2 masks the padding but passes no lengths to ``ssm_update``: the state after a
# right-padded chunk loses the real tokens. Each entry is checked by
# tests/engine/test_speculation_kinds.py (rows of different lengths fed again).
_STATES_TAKE_LENGTHS = frozenset({"qwen3_5", "qwen3_5_moe", "qwen3_next", "falcon_h1",
                                  "kimi_linear"})


def states_take_lengths(model: Any) -> bool:
    """True if ``model``'s array states can be fed right-padded rows (``prepare(lengths)``)."""
    return getattr(model, "model_type", None) in _STATES_TAKE_LENGTHS


def before_verify(batch: Sequence[Any]) -> list[list[Any]] | None:
    """Before a verify forward (several positions per row): sliding windows are put in
    temporal order (what ``BatchRotatingKVCache``'s concatenating update does first
    anyway; done before the model builds its mask from the cache, so that the mask and
    the update agree on the window's first column), and the array states are returned
    (references: the forward replaces them, so these stay the pre-verify state; None
    when there are none)."""
    for c in cache_leaves(batch):
        if isinstance(c, BatchRotatingKVCache) and c.keys is not None:
            c._temporal_order()
    states = ssm_states(batch)
    return states if states else None


def drop_row_tails(batch: Sequence[Any], counts: Sequence[int],
                   moves: Sequence[RowMoves] | None = None) -> None:
    """Drop the last ``counts[i]`` positions of row ``i`` (rejected draft tokens and
    right padding) after a verify forward: what all rows drop is trimmed; the rest of a
    row's tail becomes its left padding (mlx-lm's right-padding path: the tail is rolled
    to the left, where the mask excludes it).

    Sliding windows (``BatchRotatingKVCache``) after the concatenating update of a
    verify forward hold, in temporal order, the last ``max_size - 1`` tokens from
    before it and every position it fed. Their common tail is trimmed AND sliced off
    the buffer (``trim`` alone leaves it in the buffer, where the next single-token
    update would keep it in the window): the state is then the one a forward of only
    the kept positions would have left, and the next single-token update keeps the
    last ``max_size`` tokens of each row, as decoding one token at a time does."""
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
    """Row ``i``'s first ``rest[i]`` positions into its last ``rest[i]`` (rejected)
    ones, in every leaf; False (nothing done) unless every leaf is plain KV and every
    row holds at least twice what it moves."""
    if not leaves or not all(type(c) is BatchKVCache and c.keys is not None for c in leaves):
        return False
    pads = [int(p) for p in leaves[0].left_padding.tolist()]
    end = int(leaves[0]._idx)
    if any(n and end - pads[i] < 2 * n for i, n in enumerate(rest)):
        return False
    heads = [(c, i, n, mx.array(c.keys[i : i + 1, :, pads[i] : pads[i] + n]),
              mx.array(c.values[i : i + 1, :, pads[i] : pads[i] + n]))
             for c in leaves for i, n in enumerate(rest) if n]
    # the heads are copies with their own buffers before the writes: the writes then
    # update the caches' buffers in place (nothing else holds them)
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
    """After the right-padded forward that feeds a ``"state"`` batch's kept positions
    again (``prepare_right_padded``): the array leaves finalize (their lengths are
    done); in the KV leaves each row's pad tail (``max(kept) - kept[i]`` positions)
    becomes left padding by moving the row's first positions into it (``_move_heads``,
    recorded in ``moves``) instead of rolling every row of every layer
    (``BatchKVCache.finalize``), which stays the fallback for a row too short to move."""
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
    """Undo a verify forward of ``width`` positions on a ``"state"`` batch: array states
    back to ``states`` (``before_verify``), KV leaves trimmed by ``width``."""
    it = iter(states)
    for c in cache_leaves(batch):
        if isinstance(c, ArraysCache):
            c.cache = list(next(it))
        else:
            c.trim(width)
