"""mlx-lm cache objects <-> block payloads.

Every per-layer cache object of mlx-lm 0.32 exposes its full state through the
public ``state`` property (KVCache: keys, values, offset; RotatingKVCache: keys,
values, offset, keep, max_size, idx; QuantizedKVCache: (wq, scales, biases) x 2,
offset, group_size, bits; ArraysCache: arrays, left_padding, lengths; CacheList:
a list of sub-states). ``extract_block`` reads a token range out of a live cache
list; ``restore`` builds fresh cache objects from the payloads of consecutive
blocks. Payload names follow docs/INTERFACES.md:

- ``"<layer>.k"`` / ``"<layer>.v"``: KV of the block's tokens, ``[B, heads, n, dim]``
- ``"<layer>.k.<i>"`` / ``"<layer>.v.<i>"``: part ``i`` of a quantized KV slice
- ``"<layer>.s.<i>"``: array ``i`` of a non-KV state (SSM) snapshot at the block's end

A ``CacheList`` at layer ``L`` names its sub-caches ``"L.0"``, ``"L.1"``, ...

A payload is one ``BlockPayload`` (``blockbuf``): every array of the block packed
into one evaluated ``uint8`` buffer (a copy: a lazy slice would pin the whole cache
buffer in memory), readable by the names above. With a ``KVQuant`` spec
(``quant``), ``extract_block`` stores the KV of blocks from ``min_tokens`` on
quantized (packed values, scales, biases per group); ``restore`` dequantizes them
into the template's own cache kind, or fills a ``QuantizedKVCache`` directly.
``restore`` also accepts plain ``name -> array`` mappings (older payloads).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from ..errors import InvariantError
from . import quant as _quant
from .blockbuf import BlockPayload, Item, dtype_name, pack
from .quant import KVQuant

logger = logging.getLogger(__name__)

Payload = BlockPayload


class Span(Protocol):
    @property
    def start(self) -> int: ...

    @property
    def end(self) -> int: ...


class BlockSpan(NamedTuple):
    """Token range of a block; ``meta.BlockMeta`` has the same two properties."""

    start: int
    end: int


_KV_TYPES = (KVCache, RotatingKVCache, QuantizedKVCache)


def _leaves(caches: Sequence[Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(name, cache) for every leaf cache object; CacheList children are ``L.i``."""
    for i, c in enumerate(caches):
        name = f"{prefix}{i}"
        if isinstance(c, CacheList):
            yield from _leaves(list(c.caches), prefix=name + ".")
        else:
            yield name, c


def _check_supported(c: Any) -> None:
    if not isinstance(c, (*_KV_TYPES, ArraysCache)):
        raise ValueError(f"unsupported cache type for block storage: {type(c).__name__} "
                         "(blocks hold KVCache, RotatingKVCache, QuantizedKVCache, "
                         "ArraysCache and CacheList of those)")


def is_truncatable(caches: Sequence[Any]) -> bool:
    """True if the state can be restored at any token position (KV caches only).

    An ArraysCache (SSM / linear attention state) anywhere makes the model
    non-truncatable: it can be restored only where a snapshot was stored.
    """
    for _, c in _leaves(caches):
        _check_supported(c)
        if isinstance(c, ArraysCache):
            return False
    return True


def _model_dtype(model: Any) -> str:
    from mlx.utils import tree_flatten

    for _, p in tree_flatten(model.parameters()):
        if isinstance(p, mx.array) and mx.issubdtype(p.dtype, mx.floating):
            return str(p.dtype).replace("mlx.core.", "")
    return "float32"


def kv_spec(model: Any, caches: Sequence[Any] | None = None, quant: KVQuant | None = None) -> str:
    """A namespace string for the KV representation: dtype, quantization, layer kinds,
    and how blocks are stored (``quant``: e.g. ``;q8g64m256``; nothing for full precision).

    Two processes share blocks only if they agree on this (plus the model
    fingerprint, block size and tenant in the namespace root), so a full-precision
    block is never served where quantized ones are expected, or the reverse.
    """
    if caches is None:
        caches = make_prompt_cache(model)
    kinds = []
    live_quant = ""
    for _, c in _leaves(caches):
        _check_supported(c)
        if isinstance(c, QuantizedKVCache):
            live_quant = f"/q{c.bits}g{c.group_size}"
            kinds.append("q")
        elif isinstance(c, RotatingKVCache):
            kinds.append(f"r{c.max_size}k{c.keep}")
        elif isinstance(c, KVCache):
            kinds.append("kv")
        else:
            kinds.append(f"s{len(c.cache)}")
    # run-length compress the layer kinds to keep the spec short
    parts: list[str] = []
    for k in kinds:
        if parts and parts[-1].rsplit("*", 1)[0] == k:
            head, _, n = parts[-1].partition("*")
            parts[-1] = f"{head}*{int(n or 1) + 1}"
        else:
            parts.append(k)
    stored = f";{quant.spec}" if quant is not None else ""
    return f"{_model_dtype(model)}{live_quant};{','.join(parts)}{stored}"


# ---------------------------------------------------------------- rotating cache


def _rotating_segments(c: RotatingKVCache, start: int, end: int) -> list[tuple[int, int]]:
    """Raw buffer index ranges holding the tokens ``[start, end)``, in order.

    The temporal order of the buffer is derived from the public state
    (keys, values, offset, keep, max_size, idx), mirroring mlx-lm's own rule:
    - idx == len(buffer): the buffer is in temporal order;
    - idx < offset: rotated: buffer[:keep], buffer[idx:], buffer[keep:idx];
    - otherwise: buffer[:idx] holds tokens 0..offset.
    """
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
    # temporal index -> token position: [0, keep) are tokens 0..keep-1 when tokens were
    # dropped; the rest are the last (total - keep) tokens before ``offset``.
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

    # split [start, end) into the keep part and the window part
    ranges: list[tuple[int, int]] = []
    if total != offset and start < keep:
        ranges.append((temporal_index(start), temporal_index(min(end, keep) - 1) + 1))
        start = min(end, keep)
    if start < end:
        ranges.append((temporal_index(start), temporal_index(end - 1) + 1))
    # map temporal ranges onto raw buffer ranges
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


# ---------------------------------------------------------------- extract


@functools.lru_cache(maxsize=64)
def _warn_unquantizable(head_dim: int, group_size: int) -> None:
    logger.warning("KV of head_dim %d cannot be quantized in groups of <= %d (mx.quantize "
                   "supports %s): those layers are stored at full precision",
                   head_dim, group_size, _quant.GROUP_SIZES)


def _kv_entry(name: str, k: mx.array, v: mx.array, quant: KVQuant | None,
              start: int) -> tuple[Item, list[mx.array]]:
    """The block item of one KV layer: quantized if the spec says so for this block.

    Keys and values may differ in width (MLA: the latent and the rope key); a quantized
    item uses one group size that divides both."""
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
    """The payload of the block ``[start, end)`` from live cache objects: one buffer.

    KV slices are taken for every attention layer; a non-KV state (ArraysCache)
    is included only when ``snapshot`` is True, and then ``end`` must equal the
    current position of the cache (a state exists only for "now").
    ``quant``: store the KV quantized (blocks from ``quant.min_tokens`` on; a
    QuantizedKVCache layer is stored as it is, quantized with its own bits).
    """
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
    return pack(entries)


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


# ---------------------------------------------------------------- restore


def _template(model_or_caches: Any) -> list[Any]:
    if isinstance(model_or_caches, (list, tuple)):
        return list(model_or_caches)
    return list(make_prompt_cache(model_or_caches))


class _Used(NamedTuple):
    """A block restore reads: its span, its payload and the payload's arrays (views)."""

    start: int
    end: int
    payload: Mapping[str, mx.array]
    arrays: Mapping[str, mx.array]


def _cut_blocks(
    blocks: Sequence[tuple[Span, Mapping[str, mx.array]]], num_tokens: int
) -> list[_Used]:
    """Blocks covering [0, num_tokens), checked for contiguity."""
    out = []
    pos = 0
    for span, payload in blocks:
        if pos >= num_tokens:
            break
        if span.start != pos:
            raise ValueError(f"blocks are not contiguous: expected start {pos}, got {span.start}")
        arrays = payload.arrays() if isinstance(payload, BlockPayload) else payload
        out.append(_Used(span.start, span.end, payload, arrays))
        pos = span.end
    if pos < num_tokens:
        raise ValueError(f"blocks cover {pos} tokens, fewer than num_tokens={num_tokens}")
    return out


def _cat(parts: Sequence[mx.array]) -> mx.array:
    return parts[0] if len(parts) == 1 else mx.concatenate(list(parts), axis=2)


class _Seg(NamedTuple):
    """One block's slice of one KV layer: "kv" (k, v), "q" (k0-2, v0-2, with bits and
    group size) or "raw_q" (quantized parts of an older payload: bits unknown)."""

    kind: str
    arrays: tuple[mx.array, ...]
    bits: int = 0
    group_size: int = 0


def _kind_of(payload: Mapping[str, mx.array], name: str, s: int, e: int) -> tuple[str, int, int]:
    if isinstance(payload, BlockPayload):
        item = payload.layout.kv_items.get(name)
        if item is not None:
            return ("q", item.bits, item.group_size) if item.kind == "q" else ("kv", 0, 0)
    if f"{name}.k" in payload:
        return "kv", 0, 0
    if f"{name}.k.0" in payload:
        return "raw_q", 0, 0
    raise ValueError(f"block [{s}, {e}) has no array {name + '.k'!r}")


def _segments(blocks: list[_Used], name: str, lo: int, hi: int) -> list[_Seg]:
    """The slices of layer ``name`` covering tokens [lo, hi) across blocks."""
    kv_keys = (f"{name}.k", f"{name}.v")
    q_keys = tuple(f"{name}.{kv}.{i}" for kv in "kv" for i in range(3))
    out = []
    for s, e, payload, arrays in blocks:
        if e <= lo or s >= hi:
            continue
        kind, bits, group = _kind_of(payload, name, s, e)
        keys = kv_keys if kind == "kv" else q_keys
        got = []
        for key in keys:
            a = arrays.get(key)
            if a is None:
                raise ValueError(f"block [{s}, {e}) has no array {key!r}")
            if a.shape[2] != e - s:
                raise ValueError(
                    f"array {key!r} of block [{s}, {e}) holds {a.shape[2]} tokens, expected {e - s}"
                )
            got.append(a)
        a0, a1 = max(lo, s) - s, min(hi, e) - s
        if (a0, a1) != (0, e - s):
            got = [a[..., a0:a1, :] for a in got]
        out.append(_Seg(kind, tuple(got), bits, group))
    return out


def _runs(segs: list[_Seg]) -> list[list[_Seg]]:
    """Consecutive segments of the same kind and quantization."""
    runs: list[list[_Seg]] = []
    for seg in segs:
        key = (seg.kind, seg.bits, seg.group_size)
        if runs and (runs[-1][0].kind, runs[-1][0].bits, runs[-1][0].group_size) == key:
            runs[-1].append(seg)
        else:
            runs.append([seg])
    return runs


def _zeros_like_tokens(a: mx.array, n: int) -> mx.array:
    return mx.zeros((*a.shape[:2], n, a.shape[3]), dtype=a.dtype)


def _float_kv(segs: list[_Seg], pad: int = 0) -> tuple[mx.array, mx.array]:
    """Full-precision k and v in token order, plus ``pad`` zero tokens of room.

    Consecutive quantized blocks are concatenated first and dequantized in one call per
    layer; when the KV ends with them, the room is padded onto the quantized parts (a
    zero scale and bias dequantize to 0), so the result is written once.
    """
    ks: list[mx.array] = []
    vs: list[mx.array] = []
    runs = _runs(segs)
    for i, run in enumerate(runs):
        head = run[0]
        if head.kind == "kv":
            ks += [r.arrays[0] for r in run]
            vs += [r.arrays[1] for r in run]
            continue
        if head.kind == "raw_q":
            raise ValueError("quantized KV parts without their bits can be restored only into "
                             "a QuantizedKVCache")
        room = pad if i == len(runs) - 1 else 0
        parts = []
        for p in range(6):
            pieces = [r.arrays[p] for r in run]
            if room:
                pieces.append(_zeros_like_tokens(pieces[0], room))
            parts.append(_cat(pieces))
        ks.append(_quant.dequantize(parts[:3], head.bits, head.group_size))
        vs.append(_quant.dequantize(parts[3:], head.bits, head.group_size))
        pad -= room
    if pad:
        ks.append(_zeros_like_tokens(ks[0], pad))
        vs.append(_zeros_like_tokens(vs[0], pad))
    return _cat(ks), _cat(vs)


def _quantized_kv(segs: list[_Seg], bits: int, group: int) -> tuple[tuple[mx.array, ...], ...]:
    """``(k parts, v parts)`` quantized with ``bits`` / ``group``: stored parts with the
    same quantization as they are, anything else (re)quantized."""
    pieces: list[list[mx.array]] = [[] for _ in range(6)]
    for seg in segs:
        if seg.kind == "raw_q" or (seg.kind == "q" and (seg.bits, seg.group_size) == (bits, group)):
            parts = list(seg.arrays)
        else:
            if seg.kind == "kv":
                k, v = seg.arrays
            else:
                k = _quant.dequantize(seg.arrays[:3], seg.bits, seg.group_size)
                v = _quant.dequantize(seg.arrays[3:], seg.bits, seg.group_size)
            parts = [*_quant.quantize(k, bits, group), *_quant.quantize(v, bits, group)]
        for p, a in zip(pieces, parts, strict=True):
            p.append(a)
    cat = [_cat(p) for p in pieces]
    return tuple(cat[:3]), tuple(cat[3:])


def restore(
    model_or_caches: Any,
    blocks: Sequence[tuple[Span, Mapping[str, mx.array]]],
    num_tokens: int,
    *,
    reserve: int = 0,
) -> list[Any]:
    """Fresh cache objects holding the state after ``num_tokens`` tokens.

    ``reserve``: room for that many more tokens is allocated in plain KV layers
    (rounded up to mlx-lm's growth step), so the prefill that follows writes in
    place instead of copying the whole restored KV into a larger buffer.

    ``blocks`` are consecutive ``(span, payload)`` pairs from position 0 (a
    ``BlockMeta`` is a span). KV layers: concatenate and cut at ``num_tokens``
    (quantized blocks are dequantized, or kept quantized for a QuantizedKVCache).
    Rotating layers: the ``keep`` tokens plus the last window. Non-KV states:
    the snapshot of the block ending exactly at ``num_tokens``.
    The returned arrays are evaluated.
    """
    template = _template(model_or_caches)
    if num_tokens <= 0:
        return template
    used = _cut_blocks(blocks, num_tokens)
    if reserve < 0:
        raise ValueError(f"reserve must be >= 0, got {reserve}")
    out = [_restore_one(str(i), c, used, num_tokens, reserve) for i, c in enumerate(template)]
    arrays = [a for _, a in state_arrays(out)]
    mx.eval(arrays)
    return out


def _restore_one(name: str, c: Any, blocks: list[_Used], n: int, reserve: int = 0) -> Any:
    if isinstance(c, CacheList):
        return CacheList(
            *(_restore_one(f"{name}.{j}", sub, blocks, n, reserve) for j, sub in enumerate(c.caches))
        )
    _check_supported(c)
    if isinstance(c, ArraysCache):
        s, e, _, payload = blocks[-1]
        if e != n:
            raise ValueError(
                f"non-truncatable state can be restored only at a snapshot: "
                f"last block ends at {e}, num_tokens={n}"
            )
        prefix = f"{name}.s."
        size = len(c.cache)
        arrays: list[mx.array | None] = [payload.get(f"{prefix}{i}") for i in range(size)]
        if all(a is None for a in arrays):
            raise ValueError(f"block [{s}, {e}) has no state snapshot for layer {name}")
        fresh = ArraysCache(size)
        fresh.cache = arrays
        return fresh
    if isinstance(c, QuantizedKVCache):
        kq, vq = _quantized_kv(_segments(blocks, name, 0, n), c.bits, c.group_size)
        return QuantizedKVCache.from_state((kq, vq, n, c.group_size, c.bits))
    if isinstance(c, RotatingKVCache):
        keep, max_size = c.keep, c.max_size
        ranges = [(0, n)] if n <= max_size else [(0, keep), (n - (max_size - keep), n)]
        segs: list[_Seg] = []
        for lo, hi in ranges:
            if hi > lo:
                segs += _segments(blocks, name, lo, hi)
        k, v = _float_kv(segs)
        return RotatingKVCache.from_state((k, v, n, keep, max_size, k.shape[2]))
    pad = 0
    if reserve > 0:
        step = KVCache.step
        pad = (n + reserve + step - 1) // step * step - n
    k, v = _float_kv(_segments(blocks, name, 0, n), pad)
    return KVCache.from_state((k, v, n))


def state_arrays(caches: Sequence[Any]) -> Iterator[tuple[str, mx.array]]:
    for name, c in _leaves(caches):
        if isinstance(c, ArraysCache):
            for i, a in enumerate(c.cache):
                if a is not None:
                    yield f"{name}.s.{i}", a
        elif isinstance(c, QuantizedKVCache):
            if c.keys is not None:
                for i, a in enumerate(c.keys):
                    yield f"{name}.k.{i}", a
                for i, a in enumerate(c.values):
                    yield f"{name}.v.{i}", a
        elif c.keys is not None:
            yield f"{name}.k", c.keys
            yield f"{name}.v", c.values


def snapshot_nbytes(caches: Sequence[Any]) -> int:
    """Bytes of a state snapshot of ``caches`` (every non-KV state array, what
    ``extract_block(..., snapshot=True)`` adds to a block), from shape x dtype."""
    return sum(int(a.nbytes) for _, c in _leaves(caches) if isinstance(c, ArraysCache)
               for a in c.cache if a is not None)


def cache_offset(caches: Sequence[Any]) -> int | None:
    """The token position of a KV cache list (None if it has no KV layer)."""
    for _, c in _leaves(caches):
        if isinstance(c, _KV_TYPES):
            return int(c.offset)
    return None


def min_window(caches: Sequence[Any]) -> int | None:
    """The smallest sliding window (RotatingKVCache.max_size), or None."""
    sizes = [c.max_size for _, c in _leaves(caches) if isinstance(c, RotatingKVCache)]
    return min(sizes) if sizes else None


def min_sliding_tokens(caches: Sequence[Any]) -> int | None:
    """The fewest tokens a sliding window holds past its kept ones (``max_size - keep``,
    the most a block may have to be stored whole while in the window), or None."""
    sizes = [c.max_size - c.keep for _, c in _leaves(caches) if isinstance(c, RotatingKVCache)]
    return min(sizes) if sizes else None


def has_sliding_window(caches: Sequence[Any]) -> bool:
    return min_window(caches) is not None


def _state_list(c: Any, num_tokens: int) -> list[mx.array | None]:
    """A leaf cache's arrays from its public ``state``; KV arrays cut to their first
    ``num_tokens`` tokens (a live KV buffer has room for more)."""
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
    """Raise ValueError, naming the layer and the reason, if the state of ``probed``
    (fresh cache objects after a forward of ``num_tokens`` tokens) does not survive a
    round trip through one block: stored with ``extract_block``, restored with
    ``restore`` into the same cache types, offsets and arrays (bit for bit at full
    precision; shapes and dtypes where ``quant`` stores the block quantized).

    Run when a model is loaded, so a model whose cache cannot be stored is refused
    there with this message instead of failing every save of every request. With a
    ``quant`` spec both kinds of blocks are checked: full precision (blocks before its
    ``min_tokens``) and quantized."""
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
