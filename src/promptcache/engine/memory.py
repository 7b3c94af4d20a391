"""The memory governor wired to one engine (``governor.py``): its holders (MLX's buffer
pool, the live states, the RAM tier), the room the running requests may take under the
hard watermark, and the admission checks (a request's predicted peak at submit, a queued
one's beside the running ones)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from ..cache import PromptCache
from ..serving_config import EngineConfig
from .governor import Holder, MemoryGovernor, process_footprint, trim_heap
from .payload.live import LiveStates
from .requests.admission import Admission
from .requests.prefill import workspace_bytes

# mlx's buffer cache is limited to 1 / CACHE_LIMIT_SHARE of the KV budget
CACHE_LIMIT_SHARE = 8


def cap_mlx_cache(limit: int) -> None:
    """Lower MLX's buffer cache limit to ``limit`` (never raise it)."""
    previous = mx.set_cache_limit(limit)
    if previous < limit:
        mx.set_cache_limit(previous)


class EngineMemory:
    def __init__(self, cfg: EngineConfig, cache: PromptCache | None, live: LiveStates | None,
                 admission: Admission, row_bytes: Callable[[int], int], weights_bytes: int,
                 heads: Any) -> None:
        self.cfg, self.cache, self.live, self.admission = cfg, cache, live, admission
        self.row_bytes, self.weights_bytes, self.heads = row_bytes, weights_bytes, heads
        self.governor = (self.build(cfg.memory_limit_bytes)
                         if cfg.memory_limit_bytes is not None else None)
        self.loaded_footprint = 0
        if self.governor is not None:
            # the running requests' KV and prefill workspace together: the hard watermark
            # less what the process holds once loaded, so a burst is admitted as it fits
            self.loaded_footprint = process_footprint()
            room = self.governor.hard - self.loaded_footprint
            budget = admission.kv_budget
            if room > 0 and (budget is None or room < budget):
                admission.kv_budget = room
                cap_mlx_cache(room // CACHE_LIMIT_SHARE)
            admission.memory_fits = self.fits

    def build(self, limit: int, footprint: Callable[[], int] = process_footprint
              ) -> MemoryGovernor:
        """A governor over the holders: MLX's pool (first, and after each holder that
        released), the live states, the RAM tier."""
        cache, live, cfg = self.cache, self.live, self.cfg

        def mlx_pool(_: float) -> int:
            # MLX's pool, then the C heap's free memory (glibc keeps what is freed)
            before, held = footprint(), int(mx.get_cache_memory())
            mx.clear_cache()
            trim_heap()
            return max(held, before - footprint())

        holders: list[Holder] = []
        if live is not None:
            holders.append(Holder("live", live.release))
        regrow: Callable[[], None] = lambda: None  # noqa: E731
        if cache is not None:
            shrunk: list[int] = []  # the budget before the governor first shrank it

            def shrink_ram(nbytes: float) -> int:
                if not shrunk:
                    shrunk.append(cache.pool.budget_bytes)
                return cache.shrink_ram(nbytes)

            def regrow_ram() -> None:  # only what the governor took (--auto-tune moves
                if shrunk:             # the budget on its own)
                    cache.resize_ram(max(shrunk.pop(), cache.pool.budget_bytes))

            holders.append(Holder("ram", shrink_ram))
            regrow = regrow_ram
        return MemoryGovernor(limit, footprint, holders, pool=Holder("mlx_cache", mlx_pool),
                              admission=self.admission.set_pressure,
                              regrow=regrow, soft=cfg.memory_soft, hard=cfg.memory_hard)

    def check(self, n_prompt: int, length: int) -> int:
        """At submit: the request's predicted peak (its KV at ``length``, the restored
        prefix's buffers, a prefill chunk's attention workspace) against the limit
        (``MemoryGovernor.admit``); returns the peak (0 without a governor)."""
        g = self.governor
        if g is None:
            return 0
        chunk = min(n_prompt, self.cfg.prefill_chunk_tokens * 3 // 2)
        peak = (self.row_bytes(length) + self.row_bytes(n_prompt)
                + workspace_bytes(1, chunk, n_prompt, self.heads))
        g.admit(peak, self.weights_bytes, self.reclaimable(),
                queue_retry_s=self.admission.retry_estimate())
        return peak

    def reclaimable(self) -> int:
        """What the holders could release now."""
        return ((self.live.nbytes if self.live is not None else 0)
                + (self.cache.pool.used_bytes if self.cache is not None else 0)
                + int(mx.get_cache_memory()))

    def fits(self, peak: int, running: int) -> bool:
        """A queued request's peak beside the running ones' (``MemoryGovernor.fits``),
        over what the process held once loaded."""
        g = self.governor
        base = max(self.weights_bytes, self.loaded_footprint)
        return g is None or g.fits(peak, base, self.reclaimable(), running)
