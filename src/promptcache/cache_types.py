"""The types of the PromptCache API: payload adapters, lookup results (Match, Hit)
and argument checks. ``cache.py`` holds the policy itself; it re-exports these."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property
from typing import Any, Protocol

import numpy as np

from .blocks.matcher import CacheMiss, Entry, entry_meta, entry_tier
from .blocks.pool import Block
from .hashing import BlockHash
from .meta import BlockMeta, ExtraKeySpan, Namespace

EncodeFn = Callable[[Mapping[str, np.ndarray], Mapping[str, str]], bytes]
DecodeFn = Callable[[bytes], tuple[dict[str, np.ndarray], dict[str, str]]]


class PayloadAdapter(Protocol):
    """How the cache sizes and (de)serializes opaque block payloads."""

    def nbytes(self, payload: Any) -> int:
        """Bytes of the payload from shape x dtype metadata (never evaluates arrays).
        Raises ValueError for a payload the adapter does not accept."""

    def to_numpy(self, payload: Any) -> dict[str, np.ndarray]: ...

    def meta(self, payload: Any) -> dict[str, str]:
        """String metadata ``from_numpy`` needs to rebuild the payload (e.g. which
        arrays are bfloat16 travelling as uint16); stored beside the arrays."""

    def from_numpy(self, arrays: dict[str, np.ndarray], meta: Mapping[str, str] | None = None
                   ) -> Any: ...


class NumpyAdapter:
    """The default adapter: payloads are ``dict[str, np.ndarray]`` of numeric arrays."""

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

    def to_numpy(self, payload: Any) -> dict[str, np.ndarray]:
        return dict(payload)

    def meta(self, payload: Any) -> dict[str, str]:
        return {}

    def from_numpy(self, arrays: dict[str, np.ndarray], meta: Mapping[str, str] | None = None
                   ) -> Any:
        return arrays


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


class Hit:
    """Blocks referenced for a request (``acquire``); give them back with ``release``.
    ``blocks`` are ``(BlockMeta, payload)`` in order; the last one may extend past
    ``num_tokens`` and must be truncated by the engine."""

    def __init__(self, held: list[Block], num_tokens: int, num_prompt_tokens: int,
                 tokens_by_tier: dict[str, int], tiers: list[str], miss: CacheMiss | None) -> None:
        self._held = held
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
