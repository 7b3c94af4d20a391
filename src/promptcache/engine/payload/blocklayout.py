"""Block layouts: the short text (``Layout.text``) saying where each of a block's arrays lies.

Items ``NAMES=KIND:DTYPE:SHAPE`` joined by ``;`` (e.g. ``"0-29=kv:bfloat16:1x3x64x64"``; MLA:
``KSHAPE,VSHAPE``). Parts are ``ALIGN``-ed, grouped by class; equal neighbours form runs restored
with one ``mx.split``."""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import mlx.core as mx

from . import quant

ALIGN = 64  # bytes; every part starts at a multiple (a cache line, any dtype's size)

DTYPES: dict[str, mx.Dtype] = {
    name: getattr(mx, name)
    for name in ("bool_", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32",
                 "int64", "float16", "bfloat16", "float32", "float64")
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
NAME_RE = re.compile(r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*$")
_KIND_RE = re.compile(r"^(kv|raw|s(\d+)|q(\d+)g(\d+))$")
_RANGE_RE = re.compile(r"^(\d+)-(\d+)$")
# bit widths mx.quantize (affine) packs: mlx-lm's QuantizedKVCache KV is stored as it is
_LAYOUT_BITS = (1, 2, 3, 4, 5, 6, 8)


def dtype_name(dtype: mx.Dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported payload dtype {dtype}") from None


@dataclass(frozen=True, slots=True)
class Item:
    """One layer's entry: ``kind`` "kv", "q", "s" or "raw"; ``vshape``: V's shape if unlike K."""

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    bits: int = 0
    group_size: int = 0
    index: int = 0
    vshape: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.vshape is not None and tuple(self.vshape) == tuple(self.shape):
            object.__setattr__(self, "vshape", None)
        if self.vshape is not None and self.kind not in ("kv", "q"):
            raise ValueError(f"only KV items have a separate value shape ({self.name!r})")

    @property
    def value_shape(self) -> tuple[int, ...]:
        return self.shape if self.vshape is None else self.vshape

    @property
    def code(self) -> str:
        if self.kind == "q":
            return f"q{self.bits}g{self.group_size}"
        if self.kind == "s":
            return f"s{self.index}"
        return self.kind

    def parts(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(part name, dtype name, shape) of the arrays this item holds, in buffer order."""
        n = self.name
        if self.kind == "kv":
            return [(f"{n}.k", self.dtype, self.shape), (f"{n}.v", self.dtype, self.value_shape)]
        if self.kind == "q":
            out = []
            for kv, shape in (("k", self.shape), ("v", self.value_shape)):
                *lead, dim = shape
                packed = (*lead, quant.packed_dim(dim, self.bits))
                groups = (*lead, dim // self.group_size)
                out += [(f"{n}.{kv}.0", "uint32", packed), (f"{n}.{kv}.1", self.dtype, groups),
                        (f"{n}.{kv}.2", self.dtype, groups)]
            return out
        if self.kind == "s":
            return [(f"{n}.s.{self.index}", self.dtype, self.shape)]
        return [(n, self.dtype, self.shape)]

    def part_classes(self) -> tuple[int, ...]:
        """The buffer class of each of ``parts()`` (the buffer is ordered by class)."""
        if self.kind == "q":
            return (0, 1, 2, 0, 1, 2)
        if self.kind == "kv":
            return (0, 0)
        return (3,) if self.kind == "s" else (0,)


@dataclass(frozen=True, slots=True)
class Part:
    name: str
    offset: int  # bytes from the buffer's start (a multiple of ALIGN)
    nbytes: int
    dtype: mx.Dtype
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # row-major, in elements

    @property
    def elem_offset(self) -> int:
        return self.offset // self.dtype.size


@dataclass(frozen=True, eq=False)
class Layout:
    """Where each array of a block sits in its buffer (shared by equal layouts)."""

    text: str
    items: tuple[Item, ...]
    parts: Mapping[str, Part]
    nbytes: int
    # KV / quantized-KV items by layer name, snapshot items by layer name
    kv_items: Mapping[str, Item]
    num_tokens: int | None  # tokens of the block (the KV's axis 2), None without KV
    # maximal runs of adjacent parts of one dtype and shape: (first part, names)
    runs: tuple[tuple[Part, tuple[str, ...]], ...] = ()

    @property
    def quantized(self) -> bool:
        return any(i.kind == "q" for i in self.kv_items.values())


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _shape_text(shape: tuple[int, ...]) -> str:
    return "x".join(str(d) for d in shape)


def _item_code(item: Item) -> str:
    shape = _shape_text(item.shape)
    if item.vshape is not None:
        shape += "," + _shape_text(item.vshape)
    return f"{item.code}:{item.dtype}:{shape}"


def _parse_shape(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split("x")) if text else ()


def format_layout(items: Sequence[Item]) -> str:
    """The layout string of ``items`` (consecutive equal top-level layers as ``a-b``)."""
    out: list[str] = []
    run: tuple[int, int, str] | None = None  # (first, last, code) of an integer-name run
    for item in items:
        code = _item_code(item)
        if item.name.isdigit():
            i = int(item.name)
            if run is not None and run[2] == code and run[1] + 1 == i:
                run = (run[0], i, code)
                continue
            if run is not None:
                out.append(_run_text(run))
            run = (i, i, code)
            continue
        if run is not None:
            out.append(_run_text(run))
            run = None
        out.append(f"{item.name}={code}")
    if run is not None:
        out.append(_run_text(run))
    return ";".join(out)


def _run_text(run: tuple[int, int, str]) -> str:
    a, b, code = run
    return f"{a}={code}" if a == b else f"{a}-{b}={code}"


def _parse_item(names: str, code: str) -> list[Item]:
    try:
        kind, dtype, shape_text = code.split(":")
        k_text, sep, v_text = shape_text.partition(",")
        shape = _parse_shape(k_text)
        vshape = _parse_shape(v_text) if sep else None
    except ValueError:
        raise ValueError(f"bad layout item {names}={code!r}") from None
    if dtype not in DTYPES or any(d < 0 for d in (*shape, *(vshape or ()))):
        raise ValueError(f"bad layout item {names}={code!r}")
    m = _KIND_RE.match(kind)
    if m is None:
        raise ValueError(f"bad layout item kind {kind!r}")
    if vshape is not None:
        if m.group(3) is None and kind != "kv":
            raise ValueError(f"only KV layout items have a value shape: {names}={code!r}")
        if vshape == shape or len(vshape) != 4 or len(shape) != 4 \
                or (vshape[0], vshape[2]) != (shape[0], shape[2]):
            raise ValueError(f"bad value shape in layout item {names}={code!r}")
    r = _RANGE_RE.match(names)
    if r is not None:
        first, last = int(r.group(1)), int(r.group(2))
        if last < first:
            raise ValueError(f"bad layout range {names!r}")
        layer_names = [str(i) for i in range(first, last + 1)]
    elif NAME_RE.match(names):
        layer_names = [names]
    else:
        raise ValueError(f"bad layout name {names!r}")
    if m.group(3) is not None:
        bits, group = int(m.group(3)), int(m.group(4))
        dims = [shape[-1] if shape else 0, *(vshape[-1:] if vshape else ())]
        if bits not in _LAYOUT_BITS or group not in quant.GROUP_SIZES or len(shape) < 1 \
                or any(d % group or (d * bits) % 32 for d in dims):
            raise ValueError(f"bad quantized layout item {names}={code!r}")
        return [Item(n, "q", dtype, shape, bits=bits, group_size=group, vshape=vshape)
                for n in layer_names]
    if m.group(2) is not None:
        return [Item(n, "s", dtype, shape, index=int(m.group(2))) for n in layer_names]
    return [Item(n, kind, dtype, shape, vshape=vshape) for n in layer_names]


@functools.lru_cache(maxsize=4096)
def parse_layout(text: str) -> Layout:
    """The ``Layout`` of a layout string (cached); ValueError if malformed."""
    if not isinstance(text, str):
        raise ValueError("a block layout must be a string")
    items: list[Item] = []
    for entry in text.split(";") if text else ():
        names, sep, code = entry.partition("=")
        if not sep:
            raise ValueError(f"bad layout entry {entry!r}")
        items.extend(_parse_item(names, code))
    kv_items: dict[str, Item] = {}
    num_tokens: int | None = None
    specs: list[tuple[int, int, str, str, tuple[int, ...]]] = []
    for item in items:
        if item.kind in ("kv", "q"):
            if item.name in kv_items or len(item.shape) != 4:
                raise ValueError(f"bad KV item for layer {item.name!r} in layout")
            kv_items[item.name] = item
            n = item.shape[2]
            if num_tokens is not None and n != num_tokens:
                raise ValueError(f"layout items disagree on the block's tokens ({n} != {num_tokens})")
            num_tokens = n
        for cls, (name, dt, shape) in zip(item.part_classes(), item.parts(), strict=True):
            specs.append((cls, len(specs), name, dt, shape))
    specs.sort()
    parts: dict[str, Part] = {}
    runs: list[tuple[Part, list[str]]] = []
    pos = 0
    for _cls, _seq, name, dt, shape in specs:
        if name in parts:
            raise ValueError(f"duplicate array {name!r} in layout")
        dtype = DTYPES[dt]
        count = 1
        for d in shape:
            count *= d
        nbytes = count * dtype.size
        start = _align(pos)
        strides = []
        step = 1
        for d in reversed(shape):
            strides.append(step)
            step *= d
        part = parts[name] = Part(name, start, nbytes, dtype, shape, tuple(reversed(strides)))
        head = runs[-1][0] if runs else None
        if (head is not None and start == pos and head.dtype == dtype and head.shape == shape
                and len(shape) > 0):
            runs[-1][1].append(name)
        else:
            runs.append((part, [name]))
        pos = start + nbytes
    return Layout(text, tuple(items), parts, _align(pos), kv_items, num_tokens,
                  tuple((head, tuple(names)) for head, names in runs))

