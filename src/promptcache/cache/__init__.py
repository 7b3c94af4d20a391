"""The prompt cache: ``PromptCache`` (``facade``) over plain parts it builds and wires
(matcher + branches, lookup, store, protect + levels, ops, lower + persist, payloads,
policy; no mixins, no shared state object); ``types``: the API's types."""

from ..stats import CacheStats
from .entries import RAM
from .facade import PromptCache
from .miss import CacheMiss
from .types import ChainCursor, Hit, Match, NumpyAdapter, PayloadAdapter

__all__ = [
    "RAM", "CacheStats", "ChainCursor", "Hit", "Match", "CacheMiss", "NumpyAdapter",
    "PayloadAdapter", "PromptCache",
]
