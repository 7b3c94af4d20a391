"""What the block adapters know of mlx-lm's caches: kinds, layer walk, truncation, KV spec."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
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

from .quant import KVQuant


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
    """True if the state can be restored at any token (with an ArraysCache: only at snapshots)."""
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
    """The namespace string of the KV representation: blocks are shared only where it agrees."""
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
    """Bytes of a state snapshot of ``caches`` (every non-KV state array), from shape x dtype."""
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
    """The fewest tokens a sliding window holds past its kept ones (``max_size - keep``) or None."""
    sizes = [c.max_size - c.keep for _, c in _leaves(caches) if isinstance(c, RotatingKVCache)]
    return min(sizes) if sizes else None


def has_sliding_window(caches: Sequence[Any]) -> bool:
    return min_window(caches) is not None
