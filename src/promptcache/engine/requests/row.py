"""A request's cache side: ``SavingRow``, a request as ``request_saves.py`` and
``splice.py`` see it (so neither imports ``request.py``; ``Request`` is one, mypy checks
it where it passes itself), and ``Splice``, its tail read on a background thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ...cache.miss import CacheMiss
from ...cache.types import ChainCursor
from ...meta import BlockMeta, ExtraKeySpan, Namespace
from ..api import GenerationRequest, Usage
from ..context import EngineContext

if TYPE_CHECKING:
    from ..models.vision import ImagePrefill

# the engine thread waits for the read at the split point at most this long (or twice
# the plan's predicted time, if longer)
MIN_WAIT_S, MAX_WAIT_S = 0.25, 2.0


def _run(work: Callable[[], list[Any]], out: Future[tuple[list[Any], float]]) -> None:
    """The background thread: ``work()`` (the tail read and made into payloads) and how
    long it took."""
    t = time.perf_counter()
    try:
        got = work()
    except BaseException as e:
        out.set_exception(e)
        return
    out.set_result((got, time.perf_counter() - t))


class Splice:
    """A tail ``metas`` (``[at, end)``, one lower tier) being read for a request by
    ``work`` on a background thread; ``overlap``: the plan's (``Plan.overlap``), timed
    against the split's measured seconds from ``started`` on."""

    def __init__(self, tier_name: str, metas: Sequence[BlockMeta], at: int, end: int,
                 predicted_s: float, overlap: tuple[float, float] | None,
                 work: Callable[[], list[Any]]) -> None:
        self.tier_name, self.overlap = tier_name, overlap
        self.metas, self.at, self.end = list(metas), at, end
        self.wait_s = min(MAX_WAIT_S, max(MIN_WAIT_S, 2 * predicted_s))
        self.future: Future[tuple[list[Any], float]] = Future()
        self.started = time.perf_counter()
        threading.Thread(target=_run, args=(work, self.future),
                         name="promptcache-tail", daemon=True).start()

    def cap(self, end: int, pos: int) -> int:
        """A chunk ending at ``end`` stops at the split point instead."""
        return min(end, self.at) if pos < self.at else end




class SavingRow(Protocol):
    ctx: EngineContext
    req: GenerationRequest
    n_prompt: int
    seq: np.ndarray
    output: list[int]
    usage: Usage
    caches: list[Any]
    pos: int
    splice: Splice | None
    phase: str
    timings: dict[str, float]
    miss: CacheMiss | None
    last_snapshot: int
    snap_at: tuple[int, ...]
    use_cache: bool
    ns: Namespace | None
    cursor: ChainCursor | None
    truncatable: bool
    sliding: bool
    extra_keys: tuple[ExtraKeySpan, ...]
    images: ImagePrefill | None

    @property
    def request_id(self) -> str: ...
