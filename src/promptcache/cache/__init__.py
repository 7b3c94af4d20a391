"""The prompt cache: ``PromptCache`` (``facade``), one facade over plain parts it builds
and wires, each given only what it needs (no mixins, no shared state object):
``matcher`` + ``branches`` (the longest restorable prefix; ``entries``, ``miss``),
``lookup`` (acquire + promotion), ``store``, ``protect`` + ``levels``, ``ops``,
``lower`` + ``persist`` (writes to the lower tiers), ``payloads`` (the codec side)
and ``policy`` (tier failures, the TTL, observers); ``types``: the API's types."""

from ..stats import CacheStats
from .entries import RAM
from .facade import PromptCache
from .miss import CacheMiss
from .types import ChainCursor, Hit, Match, NumpyAdapter, PayloadAdapter

__all__ = [
    "RAM", "CacheStats", "ChainCursor", "Hit", "Match", "CacheMiss", "NumpyAdapter",
    "PayloadAdapter", "PromptCache",
]
