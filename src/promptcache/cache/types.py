"""The types of the PromptCache API: payload adapters, lookup results (Match, Hit)
and argument checks. ``facade`` holds the policy itself; the package re-exports these."""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property
from typing import Any, NamedTuple, Protocol

import numpy as np

from ..blocks.pool import Block
from ..blocks.tokens import RequestTokens, to_request_tokens
from ..codec import Decoded
from ..hashing import BlockHash
from ..meta import BlockMeta, ExtraKeySpan, Namespace
from .entries import Entry, entry_meta, entry_tier
from .miss import CacheMiss

EncodeFn = Callable[[BlockMeta, Sequence[str], str, np.ndarray], bytes]
"""``encode(meta, sessions, layout, buffer) -> bytes`` (``codec.encode``)."""
DecodeFn = Callable[[bytes], Decoded]
"""``decode(data) -> Decoded(description, buffer)`` (``codec.decode``)."""


class PayloadAdapter(Protocol):
    """How the cache sizes and (de)serializes opaque block payloads: a payload travels
    to the lower tiers as one contiguous byte buffer plus a layout string."""

    def nbytes(self, payload: Any) -> int:
        """Bytes of the payload from shape x dtype metadata (never evaluates arrays).
        Raises ValueError for a payload the adapter does not accept."""

    def to_buffer(self, payload: Any) -> tuple[np.ndarray, str]:
        """The payload as one contiguous 1-d ``uint8`` array (a view where the payload
        already is one buffer) and the layout string ``from_buffer`` needs."""

    def from_buffer(self, buffer: np.ndarray, layout: str) -> Any:
        """Inverse of ``to_buffer``. ``buffer`` is a read-only view over the stored
        bytes (copy what must outlive them). Raises ValueError for a buffer that does
        not match its layout."""


_NP_ALIGN = 64


@functools.lru_cache(maxsize=1024)
def _np_layout_parts(layout: str) -> tuple[tuple[str, np.dtype[Any], tuple[int, ...], int, int], ...]:
    """(name, dtype, shape, offset, nbytes) of each array of a ``NumpyAdapter`` layout
    (parsed once: the blocks of one cache share a few layouts)."""
    out: list[tuple[str, np.dtype[Any], tuple[int, ...], int, int]] = []
    pos = 0
    for entry in layout.split(";") if layout else ():
        name, sep, spec = entry.partition("=")
        dt, sep2, shape_text = spec.partition(":")
        if not sep or not sep2 or not name:
            raise ValueError(f"bad numpy layout entry {entry!r}")
        try:
            dtype = np.dtype(dt)
            shape = tuple(int(d) for d in shape_text.split("x")) if shape_text else ()
        except (TypeError, ValueError):
            raise ValueError(f"bad numpy layout entry {entry!r}") from None
        if dtype.kind not in "biufc" or any(d < 0 for d in shape):
            raise ValueError(f"bad numpy layout entry {entry!r}")
        pos = (pos + _NP_ALIGN - 1) // _NP_ALIGN * _NP_ALIGN
        n = math.prod(shape) * dtype.itemsize
        out.append((name, dtype, shape, pos, n))
        pos += n
    return tuple(out)


class NumpyAdapter:
    """The default adapter: payloads are ``dict[str, np.ndarray]`` of numeric arrays.
    The buffer holds them in order, each at a multiple of 64 bytes; the layout is
    ``name=dtype:shape`` per array (numpy's dtype string, e.g. ``<f4``; the shape as
    ``1x2x8``), separated by ``;``."""

    def nbytes(self, payload: Any) -> int:
        if not isinstance(payload, Mapping):
            raise ValueError(f"payload must be a mapping of name -> np.ndarray, got {type(payload).__name__}")
        total = 0
        for name, arr in payload.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"payload array names must be non-empty strings, got {name!r}")
            if not isinstance(arr, np.ndarray):
                raise ValueError(f"payload array {name!r} must be a numpy array, got {type(arr).__name__}")
            if arr.dtype.kind not in "biufc":
                raise ValueError(f"payload array {name!r} has unsupported dtype {arr.dtype}")
            total += int(arr.nbytes)
        return total

    def to_buffer(self, payload: Any) -> tuple[np.ndarray, str]:
        self.nbytes(payload)
        entries = []
        for name, arr in payload.items():
            if "=" in name or ";" in name:
                raise ValueError(f"payload array name {name!r} cannot be stored ('=' or ';')")
            shape = "x".join(str(d) for d in arr.shape)
            entries.append(f"{name}={arr.dtype.str}:{shape}")
        layout = ";".join(entries)
        parts = _np_layout_parts(layout)
        end = parts[-1][3] + parts[-1][4] if parts else 0
        buffer = np.zeros((end + _NP_ALIGN - 1) // _NP_ALIGN * _NP_ALIGN, dtype=np.uint8)
        for (_name, _dt, _shape, offset, _n), arr in zip(parts, payload.values(), strict=True):
            flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
            buffer[offset:offset + flat.size] = flat
        return buffer, layout

    def from_buffer(self, buffer: np.ndarray, layout: str) -> Any:
        out: dict[str, np.ndarray] = {}
        for name, dtype, shape, offset, n in _np_layout_parts(layout):
            if offset + n > buffer.size:
                raise ValueError(f"array {name!r} ends past the {buffer.size}-byte buffer")
            out[name] = buffer[offset:offset + n].view(dtype).reshape(shape)
        return out


def tokens_by_tier_of(entries: Sequence[Entry], num_tokens: int) -> dict[str, int]:
    out: Counter[str] = Counter()
    for e in entries:
        out[entry_tier(e)] += min(e.end, num_tokens) - e.start
    return dict(out)


class Match:
    """The result of ``lookup``: a pure query. ``blocks``/``tiers``/``tokens_by_tier``
    are computed on first access (a 2,000-block match stays cheap to return)."""

    def __init__(self, entries: list[Entry], num_tokens: int, matched_tokens: int,
                 miss: CacheMiss | None) -> None:
        self._entries = entries
        self.num_tokens = num_tokens
        self.matched_tokens = matched_tokens  # token LCP found, restorable or not
        self.miss = miss

    @cached_property
    def blocks(self) -> list[BlockMeta]:
        return [entry_meta(e) for e in self._entries]

    @cached_property
    def tiers(self) -> list[str]:
        return [entry_tier(e) for e in self._entries]

    @cached_property
    def tokens_by_tier(self) -> dict[str, int]:
        return tokens_by_tier_of(self._entries, self.num_tokens)

    def __repr__(self) -> str:
        return f"Match(num_tokens={self.num_tokens}, blocks={len(self._entries)}, miss={self.miss})"


class TierRead(NamedTuple):
    """One batched read of a lower tier during a promotion (its bytes made into
    payloads): the engine's measured tier rates (``engine/payload/planner.py``)."""

    tier: str
    blocks: int
    nbytes: int
    seconds: float


class Hit:
    """Blocks referenced for a request (``acquire``); give them back with ``release``.
    ``blocks`` are ``(BlockMeta, payload)`` in order; the last one may extend past
    ``num_tokens`` and must be truncated by the engine. ``reads``: the tier reads the
    promotion made."""

    def __init__(self, held: list[Block], num_tokens: int, num_prompt_tokens: int,
                 tokens_by_tier: dict[str, int], tiers: list[str], miss: CacheMiss | None,
                 reads: Sequence[TierRead] = ()) -> None:
        self._held = held
        self.reads = tuple(reads)
        self.num_tokens = num_tokens
        self.num_prompt_tokens = num_prompt_tokens
        self.tokens_by_tier = tokens_by_tier
        self.tiers = tiers
        self.miss = miss
        self.released = False

    @cached_property
    def blocks(self) -> list[tuple[BlockMeta, Any]]:
        return [(b.meta(), b.payload) for b in self._held]

    def __repr__(self) -> str:
        return f"Hit(num_tokens={self.num_tokens}, blocks={len(self._held)}, miss={self.miss})"


class ChainCursor:
    """Where one request's chain stands, so that repeated saves of a growing sequence
    hash only their new blocks (``PromptCache.store(..., cursor=)``).

    ``start``: a block boundary; the blocks of ``[0, start)`` are stored (or were hit)
    and ``parent`` is the hash of the block ending at ``start`` (``ns.root`` at 0).
    ``store`` begins its walk there and moves the cursor to the end of the last full
    block it stored or found. ``after_hit`` starts a cursor behind the full blocks of
    a hit (their hashes are known)."""

    __slots__ = ("ns", "parent", "start")

    def __init__(self, ns: Namespace, start: int = 0, parent: BlockHash | None = None) -> None:
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"cursor start must be a non-negative integer, got {start!r}")
        if start % ns.block_size:
            raise ValueError(f"cursor start {start} is not a multiple of the block size")
        if (start == 0) != (parent is None):
            raise ValueError("a cursor has a parent hash exactly when start > 0")
        self.ns = ns
        self.start = start
        self.parent = parent

    @classmethod
    def after_hit(cls, ns: Namespace, blocks: Sequence[BlockMeta], num_tokens: int
                  ) -> ChainCursor:
        """A cursor behind the full blocks of ``blocks`` that end at or before
        ``num_tokens`` (the restored position of a hit)."""
        cur = cls(ns)
        bs = ns.block_size
        for meta in blocks:
            if meta.start != cur.start or meta.end - meta.start != bs or meta.end > num_tokens:
                break
            cur.start, cur.parent = meta.end, meta.block_hash
        return cur

    def __repr__(self) -> str:
        return f"ChainCursor(start={self.start})"


def check_spans(extra_keys: Sequence[ExtraKeySpan]) -> tuple[ExtraKeySpan, ...]:
    spans = tuple(extra_keys)
    for s in spans:
        if not isinstance(s, ExtraKeySpan):
            raise ValueError(f"extra_keys must be ExtraKeySpan items, got {type(s).__name__}")
    return spans


def check_ns(ns: Namespace, block_size: int) -> None:
    if not isinstance(ns, Namespace):
        raise ValueError(f"namespace must be a Namespace, got {type(ns).__name__}")
    if ns.block_size != block_size:
        raise ValueError(f"namespace block_size {ns.block_size} != cache block_size {block_size}")


def check_request(tokens: Any, ns: Namespace, extra_keys: Sequence[ExtraKeySpan],
                  block_size: int) -> tuple[RequestTokens, tuple[ExtraKeySpan, ...]]:
    """A request's tokens, namespace and extra keys checked (ValueError)."""
    req = to_request_tokens(tokens)
    check_ns(ns, block_size)
    return req, check_spans(extra_keys)
