"""A request's cache side: ``lookup_and_restore`` at its start and the stores of its save points
(mid-prefill, end of prompt, window moves and end of generation), all through its ``ChainCursor``.
A cache exception is logged, counted by cause (``store_error_cause``) and becomes a miss or a
skipped save."""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence
from typing import Any

from mlx_lm.models.cache import make_prompt_cache

from ...cache.miss import CACHE_ERROR, RESTORE_ERROR, CacheMiss
from ...cache.types import ChainCursor
from ...meta import BlockMeta
from .. import mlx_compat
from ..context import store_error_cause
from ..payload import adapters
from ..payload.blockbuf import BlockPayload
from ..payload.live import grow, keep_position
from ..payload.planner import Plan
from .row import SavingRow
from .splice import start_splice

logger = logging.getLogger(__name__)


def cut_by_tier(by_tier: Any, n: int) -> dict[str, int]:
    """Per-tier cached token counts, trimmed to the ``n`` tokens actually restored."""
    out: dict[str, int] = {}
    left = n
    for tier, count in dict(by_tier or {}).items():
        take = min(int(count), left)
        if take > 0:
            out[str(tier)] = take
        left -= take
    return out


def lookup_and_restore(req: SavingRow) -> None:
    """Lookup + restore at the start (a miss is kept as data: ``req.miss``); any cache
    exception turns into a miss."""
    cache, ns = req.ctx.cache, req.ns
    if cache is None or ns is None:  # pragma: no cover - use_cache implies both
        return
    n_prompt = req.n_prompt
    planner = req.ctx.planner
    plans: list[tuple[Plan | None, Any]] = []

    def decide(match: Any) -> int:
        p = planner.decide(match, n_prompt - 1)
        plans.append((p, match))
        return int(match.num_tokens) if p is None else p.keep

    t = time.perf_counter()
    try:
        hit = cache.acquire(req.seq[:n_prompt], ns, extra_keys=req.extra_keys,
                            session_id=req.req.session_id, plan=decide)
    except Exception:
        logger.exception("cache lookup failed; prefilling the whole prompt")
        req.ctx.counters.cache_errors += 1
        req.miss = CacheMiss(CACHE_ERROR, 0, 0, n_prompt).at_message(req.req.message_starts)
        req.timings["lookup_s"] = time.perf_counter() - t
        return
    req.timings["lookup_s"] = time.perf_counter() - t
    c = req.ctx.counters
    for r in hit.reads:
        planner.rates.record_read(r.tier, 1, r.nbytes, r.seconds)
        c.rate_read_samples += 1
    t = time.perf_counter()
    try:
        miss: CacheMiss | None = hit.miss
        if miss is not None:
            req.miss = miss.at_message(req.req.message_starts)
        n = min(int(hit.num_tokens), n_prompt - 1)  # an exact hit re-runs the last token
        if _continue_live(req, n, [m for m, _ in hit.blocks]):
            if n < req.pos:
                req.miss = None  # the live state went past where the blocks stop
            return
        plan, match = plans[0] if plans else (None, None)
        if plan is not None:
            _count_plan(req, plan)
        if n > 0:
            blocks = hit.blocks
            tally = adapters.RestoreTally()
            t_restore = time.perf_counter()
            req.caches = adapters.restore(req.ctx.model, blocks, n,
                                          reserve=n_prompt - n + 1, tally=tally)
            used = [m for m, _ in blocks if m.start < n]
            planner.rates.restore.add(len(used), sum(m.nbytes for m in used),
                                      time.perf_counter() - t_restore)
            c.restores += 1
            c.restored_blocks += len(used)
            c.restore_copies += tally.copies
            c.restore_copy_bytes += tally.bytes
            req.pos = n
            req.usage.cached_tokens = n
            req.usage.cached_by_tier = cut_by_tier(hit.tokens_by_tier, n)
            if req.ns is not None:
                req.cursor = ChainCursor.after_hit(req.ns, [m for m, _ in blocks], n)
        if plan is not None and plan.kind == "split" and req.pos == plan.head:
            req.splice = start_splice(req, plan, match)
    except Exception:
        logger.exception("restoring cached blocks failed; prefilling the whole prompt")
        req.ctx.counters.restore_errors += 1
        req.caches = list(make_prompt_cache(req.ctx.model))
        req.pos = 0
        req.usage.cached_tokens = 0
        req.usage.cached_by_tier = {}
        req.miss = CacheMiss(RESTORE_ERROR, 0, 0, n_prompt).at_message(
            req.req.message_starts)
        req.cursor = ChainCursor(req.ns) if req.ns is not None else None
        req.splice = None
    finally:
        try:
            cache.release(hit)
        except Exception:
            logger.exception("cache release failed")
            req.ctx.counters.cache_errors += 1
        req.timings["restore_s"] = time.perf_counter() - t


def _count_plan(req: SavingRow, plan: Plan) -> None:
    """A plan taken (restoring from blocks): counted, and named in the request's usage."""
    c = req.ctx.counters
    c.restore_plans_by_kind[plan.kind] = c.restore_plans_by_kind.get(plan.kind, 0) + 1
    c.restore_plans_by_why[plan.why] = c.restore_plans_by_why.get(plan.why, 0) + 1
    c.recomputed_tokens += plan.split - plan.head
    req.usage.restore_plan = plan.describe()
    # a split's tail counts as recomputed until it is spliced in (splice.py)
    req.usage.recomputed_tokens = (plan.end if plan.kind == "split" else plan.split) - plan.head


def _continue_live(req: SavingRow, at_least: int, metas: Sequence[BlockMeta]) -> bool:
    """Continue from a live state of the request's namespace serving at least the
    ``at_least`` tokens the blocks would (``LiveStates.take`` says which it takes) (``engine/payload/live.py``): its caches become the
    request's, trimmed to the common prefix, with room for the prompt; nothing is
    restored. The cursor stands behind the hit's blocks up to there (the saves store
    what the blocks lack from these caches). False (nothing changed) when none serves."""
    live = req.ctx.live
    if live is None or req.ns is None or req.extra_keys or req.images is not None:
        return False
    try:
        taken = live.take(req.ns, req.seq[:req.n_prompt], at_least,
                          session=req.req.session_id)
        if taken is None:
            return False
        caches, n = taken
        grow(caches, req.n_prompt + 1)
    except Exception:
        logger.exception("continuing from a live state failed; restoring from blocks")
        live.counters.errors += 1
        return False
    req.caches = caches
    req.pos = n
    req.usage.cached_tokens = n
    req.usage.cached_by_tier = {"live": n}
    req.cursor = ChainCursor.after_hit(req.ns, metas, n)
    return True


def keep_live(req: SavingRow, reason: str, caches: Sequence[Any] | None,
              state_pos: int | None) -> None:
    """At the request's end: keep its state as a live state (``engine/payload/live.py``): a
    reply's (prompt + output[:-1], as the end-of-generation save), a prefill-only
    request's (the prompt), a prefill cancelled between chunks (its private caches)."""
    live = req.ctx.live
    if live is None or not req.use_cache or req.ns is None or req.extra_keys \
            or req.images is not None:
        return
    if reason == "prefilled":
        src = caches if caches is not None else req.caches
        pos = req.n_prompt
    elif caches is not None and req.phase == "decode" and req.output:
        src = caches
        pos = state_pos if state_pos is not None else req.n_prompt + len(req.output) - 1
        pos = keep_position(src, pos, req.n_prompt + len(req.output))
    elif caches is None and req.phase == "prefill" and req.caches:
        src, pos = req.caches, req.pos
    else:
        return
    if not src or pos <= 0:
        return
    live.keep(req.ns, req.seq[:pos], src, private=src is req.caches,
              session=req.req.session_id)


def save_mid_prefill(req: SavingRow, caches: Sequence[Any] | None = None) -> None:
    """Save point 1. A non-truncatable state is snapshotted once a chunk reaches a
    multiple of ``snapshot_every_blocks`` blocks, and at every message start (a
    partial block ending there carries it when the start is inside a block)."""
    if req.truncatable:
        store(req, req.pos, "mid_prefill", include_partial=False, snapshot_at_end=True,
              caches=caches)
        return
    every = req.ctx.config.snapshot_every_blocks * req.ctx.block_size
    regular = req.pos // every > req.last_snapshot // every
    i = bisect.bisect_left(req.snap_at, req.pos)
    at_message = i < len(req.snap_at) and req.snap_at[i] == req.pos
    before = req.ctx.counters.snapshots
    store(req, req.pos, "mid_prefill", include_partial=at_message and
          req.pos % req.ctx.block_size != 0,
          snapshot_at_end=regular or at_message, caches=caches)
    if at_message:
        req.ctx.counters.message_snapshots += req.ctx.counters.snapshots - before
    if regular:
        req.last_snapshot = req.pos


def store(req: SavingRow, num_tokens: int, save_point: str, *, include_partial: bool,
          snapshot_at_end: bool, caches: Sequence[Any] | None = None) -> None:
    """One save through the request's ``ChainCursor``: blocks of ``req.seq`` up to
    ``num_tokens`` from ``caches`` (default the private ones); never raises."""
    cache, ns = req.ctx.cache, req.ns
    if not req.use_cache or cache is None or ns is None or num_tokens <= 0:
        return
    src = req.caches if caches is None else caches

    kv_quant = req.ctx.kv_quant
    counters, stateful = req.ctx.counters, not req.truncatable
    rows = _Rows(src, kv_quant, ns.block_size, num_tokens,
                 stateful and snapshot_at_end)

    def payload_for(start: int, end: int, snapshot: bool) -> BlockPayload:
        if not (snapshot and stateful):
            row = rows.take(start, end)
            if row is not None:
                return row
        payload = adapters.extract_block(src, start, end, snapshot, quant=kv_quant)
        if snapshot and stateful:
            nbytes = adapters.snapshot_nbytes(src)
            counters.snapshots += 1
            counters.snapshot_bytes += nbytes
            counters.bytes_per_snapshot = nbytes
        return payload

    try:
        created = cache.store(
            ns, req.seq, num_tokens, payload_for,
            extra_keys=req.extra_keys, session_id=req.req.session_id,
            agent_id=req.req.agent_id, truncatable=req.truncatable, snapshot_at_end=snapshot_at_end,
            include_partial=include_partial, save_point=save_point, cursor=req.cursor,
        )
    except Exception as e:
        if _window_gap(req, src):
            logger.debug("request %s: block %d left the sliding window unsaved; the "
                         "%s save stops there", req.request_id, _cursor_start(req),
                         save_point)
            req.ctx.counters.window_gaps += 1
            return
        cause = store_error_cause(e)
        logger.exception("storing blocks (%s) failed (%s); continuing without saving",
                         save_point, cause)
        c = req.ctx.counters
        c.store_errors += 1
        c.store_errors_by_cause[cause] = c.store_errors_by_cause.get(cause, 0) + 1
        _note_not_stored(req, num_tokens, cause)
        return
    attr = f"saved_{save_point}"
    setattr(req.usage, attr, getattr(req.usage, attr) + int(created))


class _Rows:
    """The full blocks one save creates, packed as rows of one slab per run
    (``adapters.extract_run``: one copy per layer array for the run, restored with one
    strided copy) on the first block's request and handed out in order. A run stops at
    ``RUN_BLOCKS``, where a quantization spec starts, and before a block that carries a
    state snapshot; anything else (a run that cannot be cut, a partial block) is packed
    on its own."""

    RUN_BLOCKS = 64

    def __init__(self, caches: Sequence[Any], quant: Any, block_size: int, num_tokens: int,
                 last_snapshot: bool) -> None:
        self.caches, self.quant, self.bs = caches, quant, block_size
        end = num_tokens // block_size * block_size
        if last_snapshot and end == num_tokens:
            end -= block_size  # the last block is snapshotted: packed on its own
        self.end = end
        self.ready: dict[int, BlockPayload] = {}
        self.failed = False

    def take(self, start: int, end: int) -> BlockPayload | None:
        if end - start != self.bs:
            return None
        row = self.ready.pop(start, None)
        if row is not None or self.failed:
            return row
        stop = min(self.end, start + self.RUN_BLOCKS * self.bs)
        q = self.quant
        if q is not None and start < q.min_tokens < stop:
            stop = start + -(-(q.min_tokens - start) // self.bs) * self.bs
        n = (stop - start) // self.bs
        if n < 2:
            return None
        try:
            run = adapters.extract_run(self.caches, start, self.bs, n, quant=q)
        except Exception:
            logger.debug("a run of %d blocks from token %d cannot be packed as one slab; "
                         "packing them one by one", n, start, exc_info=True)
            self.failed = True
            return None
        self.ready = {start + i * self.bs: p for i, p in enumerate(run)}
        return self.ready.pop(start)


def _note_not_stored(req: SavingRow, num_tokens: int, cause: str) -> None:
    """Tell the cache which blocks a failed save left out (the next lookup stopping
    there says ``not_stored: <cause>``, not ``cold``); never fails the request."""
    note = getattr(req.ctx.cache, "note_not_stored", None)
    if note is None or req.ns is None:
        return
    try:
        note(req.ns, req.seq, num_tokens, req.cursor, cause, extra_keys=req.extra_keys)
    except Exception:
        logger.exception("recording a failed save failed")
        req.ctx.counters.cache_errors += 1


def _cursor_start(req: SavingRow) -> int:
    return req.cursor.start if req.cursor is not None else 0


def _window_gap(req: SavingRow, caches: Sequence[Any]) -> bool:
    """The next block to store has left a sliding window (it can no longer be read;
    the chain cannot go past it). Never the case while every block is stored in
    time; it follows a block that was not stored (dropped: no room)."""
    if not req.sliding or req.cursor is None:
        return False
    try:
        return mlx_compat.window_floor(caches) > req.cursor.start
    except Exception:
        return False
