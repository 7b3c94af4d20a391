"""One buffer per block: a block's arrays packed into one contiguous ``uint8`` array, since Metal
caps a process's buffer count (per-layer arrays hit it near 200k tokens).

A ``BlockPayload`` is a read-only ``Mapping`` of payload names to views of it; blocks saved together
share one 2-d slab (``pack_rows``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import mlx.core as mx
import numpy as np

from .blocklayout import DTYPES, NAME_RE, Item, Layout, dtype_name, format_layout, parse_layout


class BlockPayload(Mapping[str, mx.array]):
    """A block's arrays in one ``uint8`` buffer; ``payload[name]`` is a view into it."""

    __slots__ = ("buffer", "layout", "slab", "row", "step")

    def __init__(self, buffer: mx.array, layout: Layout, slab: mx.array | None = None,
                 row: int = 0, step: int = 0) -> None:
        if not isinstance(buffer, mx.array) or buffer.dtype != mx.uint8 or buffer.ndim != 1:
            raise ValueError("a block buffer must be a 1-d uint8 mx.array")
        if buffer.size != layout.nbytes:
            raise ValueError(f"block buffer holds {buffer.size} bytes, its layout needs {layout.nbytes}")
        if slab is not None:
            step = int(slab.shape[1]) if slab.ndim == 2 else step
            rows_fit = step == layout.nbytes if slab.ndim == 2 else step >= layout.nbytes
            if (slab.dtype != mx.uint8 or slab.ndim not in (1, 2) or not rows_fit or row < 0
                    or row * step + layout.nbytes > slab.size):
                raise ValueError("a block's slab must be a uint8 mx.array of rows of its layout's "
                                 "size (2-d), or of rows ``step`` bytes apart (1-d), its row in it")
        self.buffer = buffer
        self.layout = layout
        self.slab = slab  # the run's buffer when ``buffer`` is its row ``row``
        self.row = row
        self.step = step  # bytes from one row of ``slab`` to the next

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer (from the layout: never evaluates)."""
        return self.layout.nbytes

    @property
    def num_arrays(self) -> int:
        return 1

    def __getitem__(self, name: str) -> mx.array:
        p = self.layout.parts[name]
        return mx.as_strided(self.buffer.view(p.dtype), p.shape, p.strides, p.elem_offset)

    def arrays(self) -> dict[str, mx.array]:
        """Every part as a view (one view per dtype, one ``mx.split`` per run: fewer nodes)."""
        typed: dict[mx.Dtype, mx.array] = {}
        out: dict[str, mx.array] = {}
        for head, names in self.layout.runs:
            base = typed.get(head.dtype)
            if base is None:
                base = typed[head.dtype] = self.buffer.view(head.dtype)
            if len(names) == 1:
                out[names[0]] = mx.as_strided(base, head.shape, head.strides, head.elem_offset)
                continue
            m = len(names)
            lead = head.shape[0]
            stacked = mx.as_strided(base, (m * lead, *head.shape[1:]), head.strides,
                                    head.elem_offset)
            out.update(zip(names, mx.split(stacked, m, axis=0), strict=True))
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self.layout.parts)

    def __len__(self) -> int:
        return len(self.layout.parts)

    def __contains__(self, name: object) -> bool:
        return name in self.layout.parts

    def __repr__(self) -> str:
        return f"BlockPayload({self.layout.nbytes} B, {self.layout.text!r})"


def pack(entries: Sequence[tuple[Item, Sequence[mx.array]]]) -> BlockPayload:
    """One evaluated buffer holding every item's arrays (in ``Item.parts()`` order)."""
    items = [item for item, _ in entries]
    layout = parse_layout(format_layout(items))
    placed: list[tuple[int, mx.array]] = []
    for item, arrays in entries:
        specs = item.parts()
        if len(arrays) != len(specs):
            raise ValueError(f"item {item.name!r} needs {len(specs)} arrays, got {len(arrays)}")
        for (name, dt, shape), a in zip(specs, arrays, strict=True):
            if tuple(a.shape) != shape or a.dtype != DTYPES[dt]:
                raise ValueError(f"array {name!r} is {a.dtype}{tuple(a.shape)}, its layout says "
                                 f"{dt}{shape}")
            placed.append((layout.parts[name].offset, a))
    placed.sort(key=lambda x: x[0])
    pieces: list[mx.array] = []
    pos = 0
    for offset, a in placed:
        if offset > pos:
            pieces.append(mx.zeros((offset - pos,), dtype=mx.uint8))
        pieces.append(a.reshape(-1).view(mx.uint8))
        pos = offset + a.nbytes
    if layout.nbytes > pos or not pieces:
        pieces.append(mx.zeros((layout.nbytes - pos,), dtype=mx.uint8))
    buffer = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces)
    mx.eval(buffer)
    return BlockPayload(buffer, layout)


def pack_rows(entries: Sequence[tuple[Item, Sequence[mx.array]]], n: int
              ) -> list[BlockPayload]:
    """``n`` consecutive blocks as rows of one evaluated slab (row ``i`` = ``pack`` of ``i``)."""
    if n < 1:
        raise ValueError(f"a slab holds at least one block, got {n}")
    items = [item for item, _ in entries]
    layout = parse_layout(format_layout(items))
    placed: list[tuple[int, mx.array]] = []
    for item, arrays in entries:
        if item.kind not in ("kv", "q"):
            raise ValueError(f"only KV items are packed into rows, not {item.name!r}")
        specs = item.parts()
        if len(arrays) != len(specs):
            raise ValueError(f"item {item.name!r} needs {len(specs)} arrays, got {len(arrays)}")
        for (name, dt, shape), a in zip(specs, arrays, strict=True):
            b, h, t, d = shape
            if tuple(a.shape) != (b, h, t * n, d) or a.dtype != DTYPES[dt]:
                raise ValueError(f"array {name!r} is {a.dtype}{tuple(a.shape)}, {n} blocks of "
                                 f"its layout need {dt}{(b, h, t * n, d)}")
            rows = a.reshape(b, h, n, t, d).transpose(2, 0, 1, 3, 4).reshape(n, -1)
            placed.append((layout.parts[name].offset, rows.view(mx.uint8)))
    placed.sort(key=lambda x: x[0])
    pieces: list[mx.array] = []
    pos = 0
    for offset, a in placed:
        if offset > pos:
            pieces.append(mx.zeros((n, offset - pos), dtype=mx.uint8))
        pieces.append(a)
        pos = offset + a.shape[1]
    if layout.nbytes > pos or not pieces:
        pieces.append(mx.zeros((n, layout.nbytes - pos), dtype=mx.uint8))
    slab = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=1)
    mx.eval(slab)
    rows_out = [slab[i] for i in range(n)]
    mx.eval(rows_out)
    return [BlockPayload(r, layout, slab, i) for i, r in enumerate(rows_out)]


def rows_from_host(buffers: Sequence[object], layout: Layout) -> list[BlockPayload]:
    """Blocks of one layout from host ``uint8`` buffers as rows of one slab (one array). Where
    the buffers lie at one step in one exported buffer (a segment's mapping: blocks behind
    headers of one size) the slab is that span, copied once: rows ``step`` bytes apart."""
    arrs = [np.asarray(b) for b in buffers]
    if not arrs or any(a.dtype != np.uint8 or a.shape != (layout.nbytes,) for a in arrs):
        raise ValueError(f"block buffers must be uint8 ({layout.nbytes},) each")
    span = _one_step(arrs, max((p.dtype.size for p in layout.parts.values()), default=1))
    if span is None:  # the rows stacked on the host first: a 2-d slab
        slab, step = mx.array(np.stack(arrs)), layout.nbytes
        rows = [slab[i] for i in range(len(arrs))]
    else:
        host, step = span
        slab = mx.array(host)
        rows = [slab[i * step:i * step + layout.nbytes] for i in range(len(arrs))]
    mx.eval(slab, *rows)
    return [BlockPayload(r, layout, slab, i, step) for i, r in enumerate(rows)]


def _owner(a: np.ndarray) -> object:
    """The object that exports ``a``'s memory (a memoryview's exporter, e.g. an mmap)."""
    o: object = a
    while isinstance(o, np.ndarray) and o.base is not None:
        o = o.base
    return o.obj if isinstance(o, memoryview) else o


def _one_step(arrs: Sequence[np.ndarray], align: int) -> tuple[np.ndarray, int] | None:
    """``(span, step)``: the 1-d arrays' memory from the first's start to the last's end (a
    view) when all lie at one ``step`` (>= their size, a multiple of ``align``) in the memory
    of one owner; else None."""
    if len(arrs) < 2 or not all(a.flags.c_contiguous for a in arrs):
        return None
    owner = _owner(arrs[0])
    at = [int(a.__array_interface__["data"][0]) for a in arrs]
    step = at[1] - at[0]
    if step < arrs[0].size or step % align \
            or any(b - a != step for a, b in zip(at, at[1:], strict=False)) \
            or any(_owner(a) is not owner for a in arrs[1:]):
        return None
    size = (len(arrs) - 1) * step + arrs[0].size
    return np.lib.stride_tricks.as_strided(arrs[0], (size,), (1,), writeable=False), step


def pack_named(arrays: Mapping[str, mx.array]) -> BlockPayload:
    """Pack a legacy ``name -> array`` payload into one buffer (one ``raw`` item per array)."""
    entries: list[tuple[Item, Sequence[mx.array]]] = []
    for name, a in arrays.items():
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise ValueError(f"payload array name {name!r} cannot be packed")
        entries.append((Item(name, "raw", dtype_name(a.dtype), tuple(a.shape)), [a]))
    return pack(entries)
