"""mlx-lm cache objects <-> block payloads, through each cache's public ``state``.

A payload is one evaluated ``BlockPayload`` buffer (a copy: a lazy slice would pin the cache), named
as in docs/INTERFACES.md (block payloads). ``KVQuant``: KV from ``min_tokens`` on stored quantized.
``restore`` and the cache kinds are re-exported."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from ...errors import InvariantError
from . import quant as _quant
from .block_restore import RestoreTally, restore
from .blockbuf import BlockPayload, pack, pack_rows
from .blocklayout import Item, dtype_name
from .cache_kinds import (
    BlockSpan,
    Span,
    _check_supported,
    _leaves,
    cache_offset,
    has_sliding_window,
    is_truncatable,
    kv_spec,
    min_sliding_tokens,
    min_window,
    snapshot_nbytes,
    state_arrays,
)
from .quant import KVQuant

logger = logging.getLogger(__name__)
Payload = BlockPayload

__all__ = [
    "BlockSpan",
    "Payload",
    "Span",
    "cache_offset",
    "check_storable",
    "extract_block",
    "extract_run",
    "has_sliding_window",
    "is_truncatable",
    "kv_spec",
    "min_sliding_tokens",
    "min_window",
    "payload_arrays",
    "payload_nbytes",
    "RestoreTally",
    "restore",
    "snapshot_nbytes",
    "state_arrays",
]


def _rotating_segments(c: RotatingKVCache, start: int, end: int) -> list[tuple[int, int]]:
    """Raw buffer index ranges holding tokens ``[start, end)``, in temporal order."""
    keys, _, offset, keep, _max_size, idx = c.state
    length = keys.shape[2]
    if idx == length:
        order = [(0, length)]
    elif idx < offset:
        order = [(0, keep), (idx, length), (keep, idx)]
    else:
        order = [(0, idx)]
    order = [(a, b) for a, b in order if b > a]
    total = sum(b - a for a, b in order)
    # temporal index -> token: [0, keep) are tokens 0..keep-1, the rest the last ones before offset
    if total == offset:
        first_tail = 0
        tail_start_index = 0
    else:
        first_tail = offset - (total - keep)
        tail_start_index = keep

    def temporal_index(pos: int) -> int:
        if total == offset:
            return pos
        if pos < keep:
            return pos
        if pos < first_tail:
            raise InvariantError(
                f"token {pos} is no longer in the sliding window "
                f"(window holds {first_tail}..{offset}, keep={keep})"
            )
        return tail_start_index + pos - first_tail

    ranges: list[tuple[int, int]] = []
    if total != offset and start < keep:
        ranges.append((temporal_index(start), temporal_index(min(end, keep) - 1) + 1))
        start = min(end, keep)
    if start < end:
        ranges.append((temporal_index(start), temporal_index(end - 1) + 1))
    out: list[tuple[int, int]] = []
    for t0, t1 in ranges:
        base = 0
        for a, b in order:
            n = b - a
            lo, hi = max(t0, base), min(t1, base + n)
            if lo < hi:
                out.append((a + lo - base, a + hi - base))
            base += n
    return out


def _slice_rotating(c: RotatingKVCache, start: int, end: int) -> tuple[mx.array, mx.array]:
    segs = _rotating_segments(c, start, end)
    ks = [c.keys[..., a:b, :] for a, b in segs]
    vs = [c.values[..., a:b, :] for a, b in segs]
    k = ks[0] if len(ks) == 1 else mx.concatenate(ks, axis=2)
    v = vs[0] if len(vs) == 1 else mx.concatenate(vs, axis=2)
    return k, v




@functools.lru_cache(maxsize=64)
def _warn_unquantizable(head_dim: int, group_size: int) -> None:
    logger.warning("KV of head_dim %d cannot be quantized in groups of <= %d (mx.quantize "
                   "supports %s): those layers are stored at full precision",
                   head_dim, group_size, _quant.GROUP_SIZES)


def _kv_entry(name: str, k: mx.array, v: mx.array, quant: KVQuant | None,
              start: int) -> tuple[Item, list[mx.array]]:
    """One KV layer's block item, quantized if the spec says so (MLA: one group for K and V)."""
    if v.dtype != k.dtype:
        raise ValueError(f"layer {name}: keys are {k.dtype}, values {v.dtype}; a block "
                         "stores KV of one dtype")
    dtype, shape, vshape = dtype_name(k.dtype), tuple(k.shape), tuple(v.shape)
    group = None
    if quant is not None and quant.applies_to(start):
        group = quant.group_for(shape[-1])
        if group is not None and vshape[-1] % group:
            group = quant.group_for(math.gcd(shape[-1], vshape[-1]))
        if group is None:
            _warn_unquantizable(math.gcd(shape[-1], vshape[-1]), quant.group_size)
    if quant is None or group is None:
        return Item(name, "kv", dtype, shape, vshape=vshape), [k, v]
    bits = quant.bits
    return (Item(name, "q", dtype, shape, bits=bits, group_size=group, vshape=vshape),
            [*_quant.quantize(k, bits, group), *_quant.quantize(v, bits, group)])


def extract_block(caches: Sequence[Any], start: int, end: int, snapshot: bool, *,
                  quant: KVQuant | None = None) -> BlockPayload:
    """The payload of block ``[start, end)``; a state only with ``snapshot`` (``end`` = now)."""
    return pack(_entries(caches, start, end, snapshot, quant))


def extract_run(caches: Sequence[Any], start: int, block_size: int, n: int, *,
                quant: KVQuant | None = None) -> list[BlockPayload]:
    """The payloads of ``n`` full blocks from ``start`` as rows of one slab (``pack_rows``)."""
    if n < 1 or block_size < 1:
        raise ValueError(f"a run needs n >= 1 blocks of >= 1 token, got {n} x {block_size}")
    end = start + n * block_size
    if quant is not None and quant.applies_to(start) != quant.applies_to(end - block_size):
        raise ValueError("a run's blocks must all be quantized or all not")
    entries = []
    for item, arrays in _entries(caches, start, end, False, quant):
        b, h, _, d = item.shape
        vshape = None if item.vshape is None else (*item.vshape[:2], block_size, item.vshape[3])
        entries.append((dataclasses.replace(item, shape=(b, h, block_size, d), vshape=vshape),
                        arrays))
    return pack_rows(entries, n)


def _entries(caches: Sequence[Any], start: int, end: int, snapshot: bool,
             quant: KVQuant | None) -> list[tuple[Item, list[mx.array]]]:
    if not 0 <= start < end:
        raise ValueError(f"block range must satisfy 0 <= start < end, got [{start}, {end})")
    entries: list[tuple[Item, list[mx.array]]] = []
    for name, c in _leaves(caches):
        _check_supported(c)
        if isinstance(c, ArraysCache):
            if snapshot:
                for i, a in enumerate(c.cache):
                    if a is not None:
                        entries.append((Item(name, "s", dtype_name(a.dtype), tuple(a.shape), index=i), [a]))
            continue
        if c.offset < end:
            raise InvariantError(
                f"layer {name} holds {c.offset} tokens, cannot extract [{start}, {end})"
            )
        if isinstance(c, QuantizedKVCache):
            ks = [part[..., start:end, :] for part in c.keys]
            vs = [part[..., start:end, :] for part in c.values]
            shape = (*ks[0].shape[:-1], ks[0].shape[-1] * 32 // c.bits)
            vshape = (*vs[0].shape[:-1], vs[0].shape[-1] * 32 // c.bits)
            entries.append((Item(name, "q", dtype_name(ks[1].dtype), tuple(shape), bits=c.bits,
                                 group_size=c.group_size, vshape=tuple(vshape)), [*ks, *vs]))
        elif isinstance(c, RotatingKVCache):
            k, v = _slice_rotating(c, start, end)
            entries.append(_kv_entry(name, k, v, quant, start))
        else:
            entries.append(_kv_entry(name, c.keys[..., start:end, :], c.values[..., start:end, :],
                                     quant, start))
    return entries


def payload_nbytes(payload: Mapping[str, Any]) -> int:
    """Bytes of a payload from shape x dtype metadata (never evaluates)."""
    if isinstance(payload, BlockPayload):
        return payload.nbytes
    return sum(int(a.nbytes) for a in payload.values())


def payload_arrays(payload: Mapping[str, Any]) -> int:
    """How many arrays (Metal buffers on Apple GPUs) a payload holds."""
    if isinstance(payload, BlockPayload):
        return 1
    return len(payload)


def _state_list(c: Any, num_tokens: int) -> list[mx.array | None]:
    """A leaf cache's state arrays; KV cut to ``num_tokens`` (a live buffer has room for more)."""
    if isinstance(c, ArraysCache):
        return list(c.cache)
    out: list[mx.array | None] = []
    for s in c.state:
        for a in s if isinstance(s, (list, tuple)) else (s,):
            if isinstance(a, mx.array) and a.ndim == 4:
                out.append(a[..., :num_tokens, :])
    return out


def check_storable(model_or_caches: Any, probed: Sequence[Any], num_tokens: int, *,
                   quant: KVQuant | None = None) -> None:
    """Raise ValueError (naming the layer) if ``probed``'s state does not survive a block round trip
    (at model load; with ``quant``, both kinds of block)."""
    _check_round_trip(model_or_caches, probed, num_tokens, None)
    if quant is not None:
        _check_round_trip(model_or_caches, probed, num_tokens,
                          dataclasses.replace(quant, min_tokens=0))


def _check_round_trip(model_or_caches: Any, probed: Sequence[Any], num_tokens: int,
                      quant: KVQuant | None) -> None:
    try:
        payload = extract_block(probed, 0, num_tokens, True, quant=quant)
        restored = restore(model_or_caches, [(BlockSpan(0, num_tokens), payload)], num_tokens)
    except (ValueError, InvariantError) as e:
        raise ValueError(f"this model's cache cannot be stored in blocks: {e}") from e
    live = dict(_leaves(probed))
    back = dict(_leaves(restored))
    if list(live) != list(back):
        raise ValueError(f"this model's cache cannot be stored in blocks: its layers "
                         f"{list(live)} restore as {list(back)}")
    exact = quant is None
    for name, c in live.items():
        r = back[name]
        what = f"this model's cache cannot be stored in blocks: layer {name} ({type(c).__name__})"
        if type(r) is not type(c):
            raise ValueError(f"{what} restores as {type(r).__name__}")
        if not isinstance(c, ArraysCache) and int(r.offset) != int(c.offset):
            raise ValueError(f"{what} restores at token {r.offset}, not {c.offset}")
        a, b = _state_list(c, num_tokens), _state_list(r, num_tokens)
        if len(a) != len(b):
            raise ValueError(f"{what} restores {len(b)} arrays, not {len(a)}")
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x is None or y is None:
                if x is not y:
                    raise ValueError(f"{what}: state array {i} does not restore")
                continue
            if x.shape != y.shape or x.dtype != y.dtype:
                raise ValueError(f"{what}: state array {i} is {x.dtype}{tuple(x.shape)}, "
                                 f"restores as {y.dtype}{tuple(y.shape)}")
            if exact and not mx.array_equal(x, y).item():
                raise ValueError(f"{what}: state array {i} restores with other values")
