"""Block payloads -> fresh mlx-lm cache objects (``restore``): the blocks covering a
prefix are checked for contiguity, each layer's KV concatenated (quantized blocks
dequantized into the template's own cache kind, or filled into a ``QuantizedKVCache``),
non-KV states (SSM) taken from the snapshot of the last block. Re-exported by
``adapters``, the module the engine calls."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from ...errors import InvariantError
from . import quant as _quant
from .blockbuf import BlockPayload
from .cache_kinds import (
    Span,
    _check_supported,
    state_arrays,
)

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


class RestoreTally:
    """What one restore copies: the array copies its concatenations issue (one per
    part read: a block's slice of a layer, a zero-filled room) and the bytes they
    write (the engine counters ``restore_copies`` / ``restore_copy_bytes``)."""

    __slots__ = ("copies", "bytes")

    def __init__(self) -> None:
        self.copies = 0
        self.bytes = 0

    def add(self, out: mx.array, copies: int) -> mx.array:
        self.copies += copies
        self.bytes += int(out.nbytes)
        return out


def _cat(parts: Sequence[mx.array], tally: RestoreTally | None = None) -> mx.array:
    if len(parts) == 1:
        return parts[0]
    out = mx.concatenate(list(parts), axis=2)
    return tally.add(out, len(parts)) if tally is not None else out


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


def _float_kv(segs: list[_Seg], pad: int = 0, tally: RestoreTally | None = None
              ) -> tuple[mx.array, mx.array]:
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
            parts.append(_cat(pieces, tally))
        ks.append(_quant.dequantize(parts[:3], head.bits, head.group_size))
        vs.append(_quant.dequantize(parts[3:], head.bits, head.group_size))
        pad -= room
    if pad:
        ks.append(_zeros_like_tokens(ks[0], pad))
        vs.append(_zeros_like_tokens(vs[0], pad))
    return _cat(ks, tally), _cat(vs, tally)


def _quantized_kv(segs: list[_Seg], bits: int, group: int, tally: RestoreTally | None = None
                  ) -> tuple[tuple[mx.array, ...], ...]:
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
    cat = [_cat(p, tally) for p in pieces]
    return tuple(cat[:3]), tuple(cat[3:])


def restore(
    model_or_caches: Any,
    blocks: Sequence[tuple[Span, Mapping[str, mx.array]]],
    num_tokens: int,
    *,
    reserve: int = 0,
    tally: RestoreTally | None = None,
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
    out = [_restore_one(str(i), c, used, num_tokens, reserve, tally)
           for i, c in enumerate(template)]
    arrays = [a for _, a in state_arrays(out)]
    mx.eval(arrays)
    return out


def _restore_one(name: str, c: Any, blocks: list[_Used], n: int, reserve: int = 0,
                 tally: RestoreTally | None = None) -> Any:
    if isinstance(c, CacheList):
        return CacheList(
            *(_restore_one(f"{name}.{j}", sub, blocks, n, reserve, tally)
              for j, sub in enumerate(c.caches))
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
        kq, vq = _quantized_kv(_segments(blocks, name, 0, n), c.bits, c.group_size, tally)
        return QuantizedKVCache.from_state((kq, vq, n, c.group_size, c.bits))
    if isinstance(c, RotatingKVCache):
        keep, max_size = c.keep, c.max_size
        ranges = [(0, n)] if n <= max_size else [(0, keep), (n - (max_size - keep), n)]
        segs: list[_Seg] = []
        for lo, hi in ranges:
            if hi > lo:
                segs += _segments(blocks, name, lo, hi)
        k, v = _float_kv(segs, 0, tally)
        return RotatingKVCache.from_state((k, v, n, keep, max_size, k.shape[2]))
    whole = _whole_blocks_kv(blocks, name, n, reserve, tally)
    if whole is not None:
        return KVCache.from_state((*whole, n))
    pad = 0
    if reserve > 0:
        step = KVCache.step
        pad = (n + reserve + step - 1) // step * step - n
    k, v = _float_kv(_segments(blocks, name, 0, n), pad, tally)
    return KVCache.from_state((k, v, n))


def _whole_blocks_kv(blocks: list[_Used], name: str, n: int, reserve: int,
                     tally: RestoreTally | None) -> tuple[mx.array, mx.array] | None:
    """Full-precision k and v of layer ``name`` holding the blocks whole (tokens past
    ``n`` in the last block are room; cut off, as a view, without a ``reserve``), with
    room for ``reserve`` more tokens in whole blocks of zeros; None where the general path is needed (a block stored quantized
    or of another width than the first).

    Written as ``(B, H, blocks, T, D)`` and reshaped for free: a run of consecutive
    rows of one slab is one strided copy per array, any other block one copy, the room
    one more; a lone block or run is copied into a fresh array too (the restored KV
    never aliases a stored block)."""
    first = blocks[0]
    width = first.end - first.start
    if any(u.end - u.start != width for u in blocks[:-1]) or blocks[-1].end - blocks[-1].start > width:
        return None  # only the last block may be narrower (a partial block)
    pieces: dict[str, list[mx.array]] = {"k": [], "v": []}
    viewed = False  # a piece is a strided view of a slab (its reshape copies)
    i = 0
    while i < len(blocks):
        u = blocks[i]
        kind, _, _ = _kind_of(u.payload, name, u.start, u.end)
        if kind != "kv":
            return None
        p = u.payload
        j = i + 1
        if isinstance(p, BlockPayload) and p.slab is not None and u.end - u.start == width:
            while (j < len(blocks) and blocks[j].end - blocks[j].start == width
                   and isinstance(q := blocks[j].payload, BlockPayload) and q.slab is p.slab
                   and q.row == p.row + (j - i) and q.layout is p.layout):
                j += 1
        for kv in ("k", "v"):
            key = f"{name}.{kv}"
            if isinstance(p, BlockPayload) and p.slab is not None:
                pieces[kv].append(_rows_view(p, key, j - i))
                viewed = True
                continue
            a = u.arrays.get(key)
            if a is None or a.ndim != 4:
                raise ValueError(f"block [{u.start}, {u.end}) has no array {key!r}")
            t = u.end - u.start
            if a.shape[2] != t:
                raise ValueError(f"array {key!r} of block [{u.start}, {u.end}) holds "
                                 f"{a.shape[2]} tokens, expected {t}")
            if t > width:
                return None
            if t < width:
                a = mx.concatenate([a, _zeros_like_tokens(a, width - t)], axis=2)
            pieces[kv].append(a.reshape(a.shape[0], a.shape[1], 1, width, a.shape[3]))
        i = j
    have = len(blocks) * width
    want = n + reserve if reserve > 0 else n
    more = max(0, -(-(want - have) // width))
    out = []
    for kv in ("k", "v"):
        ps = pieces[kv]
        b, h, _, _, d = ps[0].shape
        if any(p.shape[0] != b or p.shape[1] != h or p.shape[4] != d or p.dtype != ps[0].dtype
               for p in ps):
            return None
        if more:
            ps = [*ps, mx.zeros((b, h, more, width, d), dtype=ps[0].dtype)]
        whole = mx.concatenate(ps, axis=2) if len(ps) > 1 else ps[0]
        flat = whole.reshape(b, h, whole.shape[2] * width, d)  # a copy only for a lone view
        if tally is not None and (len(ps) > 1 or viewed):
            tally.add(flat, len(ps))
        out.append(flat if reserve > 0 or flat.shape[2] == n else flat[..., :n, :])
    return out[0], out[1]


def _rows_view(p: BlockPayload, key: str, count: int) -> mx.array:
    """Part ``key`` of ``count`` consecutive rows of ``p``'s slab from ``p.row`` on, as a
    strided ``(B, H, count, T, D)`` view (no copy)."""
    if p.slab is None:
        raise InvariantError("a slab view was asked of a block that is not a slab row")
    part = p.layout.parts[key]
    b, h, t, d = part.shape
    sb, sh, st, sd = part.strides
    typed = p.slab.view(part.dtype)
    row_elems = p.step // part.dtype.size  # (a multiple: rows_from_host)
    return mx.as_strided(typed, (b, h, count, t, d), (sb, sh, row_elems, st, sd),
                         p.row * row_elems + part.elem_offset)
