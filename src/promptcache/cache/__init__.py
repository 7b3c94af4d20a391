"""The prompt cache: ``PromptCache``, one facade over its parts (see ``facade``)."""

from ..stats import CacheStats
from .entries import RAM
from .facade import PromptCache
from .miss import CacheMiss
from .types import ChainCursor, Hit, Match, NumpyAdapter, PayloadAdapter

__all__ = [
    "RAM", "CacheStats", "ChainCursor", "Hit", "Match", "CacheMiss", "NumpyAdapter",
    "PayloadAdapter", "PromptCache",
]
