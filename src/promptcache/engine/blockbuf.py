"""One buffer per block: a block's arrays packed into one contiguous ``uint8`` array.

On Apple GPUs every ``mx.array`` is a Metal buffer and Metal caps the number of
buffers a process may hold, independently of their bytes (mlx-vlm caps its block
pool at 450,000 tensors for that reason). Two arrays per layer per block (six when
quantized) reach that ceiling with a 48-layer model near 200k cached tokens at
64-token blocks; one array per block is 96 (288) times further away.

A ``BlockPayload`` is that buffer plus a ``Layout``: the block's items (one per
layer: full-precision KV, quantized KV, or an array of a state snapshot), each
part's offset, dtype and shape. It is a read-only ``Mapping`` from the payload
names of docs/INTERFACES.md (``"<layer>.k"``, ``"<layer>.k.<i>"``, ``"<layer>.s.<i>"``)
to views sliced from the buffer, so code that indexes payloads keeps working.

The layout (``blocklayout.py``) travels as one short string (``Layout.text``), parsed
once and shared.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import mlx.core as mx

from .blocklayout import DTYPES, NAME_RE, Item, Layout, dtype_name, format_layout, parse_layout


class BlockPayload(Mapping[str, mx.array]):
    """A block's arrays in one ``uint8`` buffer; ``payload[name]`` is a view into it."""

    __slots__ = ("buffer", "layout")

    def __init__(self, buffer: mx.array, layout: Layout) -> None:
        if not isinstance(buffer, mx.array) or buffer.dtype != mx.uint8 or buffer.ndim != 1:
            raise ValueError("a block buffer must be a 1-d uint8 mx.array")
        if buffer.size != layout.nbytes:
            raise ValueError(f"block buffer holds {buffer.size} bytes, its layout needs {layout.nbytes}")
        self.buffer = buffer
        self.layout = layout

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
        """Every part as a view, ``{name: payload[name]}``, built with one typed view
        per dtype and one ``mx.split`` per run of equal neighbours (restore takes the
        parts of thousands of blocks: fewer graph nodes)."""
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


def pack_named(arrays: Mapping[str, mx.array]) -> BlockPayload:
    """Pack a legacy ``name -> array`` payload into one buffer (one ``raw`` item per
    array; restore reads them by name as before)."""
    entries: list[tuple[Item, Sequence[mx.array]]] = []
    for name, a in arrays.items():
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise ValueError(f"payload array name {name!r} cannot be packed")
        entries.append((Item(name, "raw", dtype_name(a.dtype), tuple(a.shape)), [a]))
    return pack(entries)
