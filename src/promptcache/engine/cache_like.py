"""The cache as the engine's request path uses it (``RequestCache``): lookup, acquire and
release a hit, store a sequence's blocks. ``PromptCache`` is one; a fake can stand in
(tests/engine/test_fake_cache.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ..cache.types import ChainCursor, Hit, Match, PayloadAdapter
from ..meta import ExtraKeySpan, Namespace


class RequestCache(Protocol):
    @property
    def adapter(self) -> PayloadAdapter | None: ...  # a tier's bytes -> payload (splice.py)

    def lookup(self, tokens: Any, ns: Namespace, extra_keys: Sequence[ExtraKeySpan] = (),
               explain: bool = False) -> Match: ...

    def acquire(self, tokens: Any, ns: Namespace, extra_keys: Sequence[ExtraKeySpan] = (),
                session_id: str | None = None,
                plan: Callable[[Match], int] | None = None) -> Hit: ...

    def release(self, hit: Hit) -> None: ...

    def store(self, ns: Namespace, tokens: Any, num_tokens: int,
              payload_for: Callable[[int, int, bool], Any], *,
              extra_keys: Sequence[ExtraKeySpan] = (), session_id: str | None = None,
              agent_id: str | None = None, truncatable: bool = True,
              snapshot_at_end: bool = True, include_partial: bool = True,
              save_point: str = "mid_prefill", cursor: ChainCursor | None = None) -> int: ...
