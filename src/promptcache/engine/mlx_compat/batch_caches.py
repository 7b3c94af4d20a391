"""mlx-lm's batch caches: merge, pad, filter and read rows of per-layer batch caches."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    CacheList,
    KVCache,
    RotatingKVCache,
)


def cache_leaves(caches: Sequence[Any]) -> list[Any]:
    """The leaf caches, ``CacheList``s flattened."""
    out: list[Any] = []
    for c in caches:
        if isinstance(c, CacheList):
            out.extend(cache_leaves(list(c.caches)))
        else:
            out.append(c)
    return out


def can_batch(caches: Sequence[Any]) -> bool:
    """True if mlx-lm can merge these caches (plain KV, windows without ``keep``, arrays, lists)."""
    for c in cache_leaves(caches):
        if type(c) is KVCache or type(c) is ArraysCache:
            continue
        if type(c) is RotatingKVCache and c.keep == 0:
            continue
        return False
    return True


# Modules whose recurrent layers honour ``ArraysCache.lengths`` in a right-padded forward (checked
# per family: tests/engine/test_batch_prefill_kinds.py; not ``nemotron_h``, see BENCHMARKS.md).
RIGHT_PADDED_STATE_MODULES = frozenset({
    "qwen3_5", "qwen3_5_moe", "qwen3_next", "falcon_h1", "kimi_linear",
})


def model_module(model: Any) -> str:
    """The mlx-lm module that implements ``model`` (``"qwen3_next"``)."""
    return str(type(model).__module__).rsplit(".", 1)[-1]


def can_batch_prefill(caches: Sequence[Any], model: Any = None) -> bool:
    """True if these caches can be prefilled right-padded beside others exactly as alone."""
    if not caches:
        return False
    states_ok = model is not None and model_module(model) in RIGHT_PADDED_STATE_MODULES
    for c in cache_leaves(caches):
        if type(c) is KVCache:
            continue
        if type(c) is RotatingKVCache and c.keep == 0:
            continue
        if type(c) is ArraysCache and states_ok:
            continue
        return False
    return True


def prefill_width(batch: Sequence[Any], lengths: Sequence[int]) -> int:
    """The width of a right-padded prefill of ``lengths`` (two beside an empty row)."""
    width = max(lengths)
    if width == 1 and min(lengths) == 0 and any(
            isinstance(c, BatchRotatingKVCache) for c in cache_leaves(batch)):
        return 2
    return width


def merge_requests(caches: Sequence[Sequence[Any]]) -> list[Any]:
    """Per-layer batch caches of several requests' caches (copies, left-padded to the longest)."""
    return [merge([c[layer] for c in caches]) for layer in range(len(caches[0]))]


def prepare_right_padded(batch: Sequence[Any], lengths: Sequence[int],
                         width: int | None = None) -> None:
    """Before a right-padded forward: row ``i`` has ``lengths[i]`` real tokens of ``width``."""
    width = max(lengths) if width is None else width
    right = [width - n for n in lengths]
    for c in batch:
        c.prepare(lengths=list(lengths), right_padding=right)


def finalize_right_padded(batch: Sequence[Any]) -> None:
    """After that forward: the pad tokens' KV moves to the left (left padding)."""
    for c in batch:
        c.finalize()


def trim_common_padding(batch: Sequence[Any]) -> None:
    """Drop the left padding all rows share (views, nothing copied)."""
    kv = [c for c in batch if isinstance(c, BatchKVCache) and c.keys is not None]
    if not kv:
        return
    m = int(cast(int, mx.min(kv[0].left_padding).item()))  # the same in every layer
    if m <= 0:
        return
    for c in kv:
        c.keys = c.keys[..., m:, :]
        c.values = c.values[..., m:, :]
        c._idx -= m
        c.left_padding = c.left_padding - m


def copy_row(batch: Sequence[Any], idx: int) -> list[Any]:
    """Private caches of row ``idx`` with their own buffers (leaving a prefill batch for decode)."""
    out = row_caches(batch, idx)
    for c in cache_leaves(out):  # KV views (in a CacheList too); the rest are copies
        if isinstance(c, KVCache) and c.keys is not None:
            c.keys = copy_array(c.keys)
            c.values = copy_array(c.values)
    return out


def merge(caches: Sequence[Any]) -> Any:
    """One batch cache of a layer from the per-request caches of that layer."""
    return type(caches[0]).merge(list(caches))


def extend(batch: Any, other: Any) -> None:
    """Append the rows of ``other`` to ``batch`` (both batch caches of one layer)."""
    batch.extend(other)


def filter_rows(batch: Any, keep: Sequence[int]) -> None:
    batch.filter(list(keep))


class RowMoves:
    """Where a decode row's first positions went (into its rejected tail), in every KV layer."""

    __slots__ = ("shift", "keys")

    def __init__(self) -> None:
        self.shift = 0  # positions moved so far: the row's left padding grew by this
        self.keys: dict[int, int] = {}  # u of a moved-to slot -> the u it held first

    def moved(self, pad: int, end: int, n: int) -> None:
        """The ``n`` positions after ``pad`` were copied to the ``n`` before ``end``."""
        origin = pad - self.shift
        dst = end - n - origin
        for j in range(n):
            src = self.shift + j
            self.keys[dst + j] = self.keys.pop(src, src)
        self.shift += n

    def order(self, pad: int, end: int) -> list[int] | None:
        """The row's physical positions in temporal order (None: never moved)."""
        if not self.keys:
            return None
        origin = pad - self.shift
        slots = sorted(range(self.shift, end - origin), key=lambda u: self.keys.get(u, u))
        return [origin + u for u in slots]


def _row_kv(c: BatchKVCache, idx: int, pads: list[int], moves: RowMoves | None) -> KVCache:
    """A KVCache of lazy views of row ``idx`` (moved rows gathered in temporal order: a copy)."""
    pad = pads[idx]
    out = KVCache()
    end = int(c._idx)
    order = moves.order(pad, end) if moves is not None else None
    if order is not None:
        ix = mx.array(order)
        out.keys = mx.take(c.keys[idx : idx + 1], ix, axis=2)
        out.values = mx.take(c.values[idx : idx + 1], ix, axis=2)
    else:
        out.keys = c.keys[idx : idx + 1, :, pad:end, :]
        out.values = c.values[idx : idx + 1, :, pad:end, :]
    out.offset = end - pad
    return out


def copy_array(x: mx.array) -> mx.array:
    """A copy with its own buffer (``mx.contiguous`` may return a slice pinning its source)."""
    return mx.array(x)


def _row_arrays(c: ArraysCache, idx: int, states: list[Any] | None) -> ArraysCache:
    src = states if states is not None else c.cache
    out = ArraysCache(len(src))
    out.cache = [None if a is None else copy_array(a[idx : idx + 1]) for a in src]
    return out


def row_caches(batch: Sequence[Any], idx: int, ssm_states: list[list[Any]] | None = None,
               moves: RowMoves | None = None) -> list[Any]:
    """Per-layer cache objects of row ``idx`` of a batch, for reading blocks out of it: KV as lazy
    views, the rest copies; nothing shares a buffer the batch writes in place."""
    states = iter(ssm_states) if ssm_states is not None else None
    pad_cache: dict[int, list[int]] = {}

    def one(c: Any) -> Any:
        if isinstance(c, CacheList):
            return CacheList(*(one(sub) for sub in c.caches))
        if isinstance(c, BatchKVCache):
            pads = pad_cache.get(id(c.left_padding))
            if pads is None:
                pads = [int(p) for p in c.left_padding.tolist()]
                pad_cache[id(c.left_padding)] = pads
            return _row_kv(c, idx, pads, moves)
        if isinstance(c, BatchRotatingKVCache):
            return c.extract(idx)
        if isinstance(c, ArraysCache):
            return _row_arrays(c, idx, next(states) if states is not None else None)
        raise TypeError(f"not a batch cache: {type(c).__name__}")

    return [one(c) for c in batch]


def ssm_states(batch: Sequence[Any]) -> list[list[Any]]:
    """The current array states of every ArraysCache leaf (references: stay the pre-step state)."""
    return [list(c.cache) for c in cache_leaves(batch) if isinstance(c, ArraysCache)]


def batch_nbytes(batch: Sequence[Any]) -> int:
    """Bytes held by a batch's caches (padding included), from shapes only."""
    total = 0
    for c in cache_leaves(batch):
        if isinstance(c, ArraysCache):
            total += sum(int(a.nbytes) for a in c.cache if a is not None)
        elif getattr(c, "keys", None) is not None:
            total += int(c.keys.nbytes) + int(c.values.nbytes)
    return total
