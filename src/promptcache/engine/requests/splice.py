"""Cake's split, run: a request's tail blocks are read from their tier and made into
payloads on a background thread while the engine thread prefills the head; at a chunk
boundary inside the tail, once they are in, the engine thread restores head + tail into
fresh caches and the split's measured time is fitted (``Rates.split``). It never waits
past a bound: a late or failed read leaves the head prefilling on (the tail recomputed).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from typing import Any

from ...cache.payloads import Payloads
from ...errors import TierError
from ...meta import BlockMeta, Namespace
from ..payload import adapters
from ..payload.cache_kinds import BlockSpan
from ..payload.planner import Plan, Planner
from .row import SavingRow, Splice

logger = logging.getLogger(__name__)


def planner_for(policy: str, template: Sequence[Any], cache: Any) -> Planner:
    """The engine's planner: its model qualifies with plain or quantized KV (no state
    snapshot, no sliding window); it splits where every lower tier has ``get_many``."""
    return Planner(policy, adapters.is_truncatable(template)
                   and not adapters.has_sliding_window(template),
                   concurrent=cache is not None and all(
                       hasattr(t, "get_many") for t in getattr(cache, "lower", ())))


def start_splice(req: SavingRow, plan: Plan, match: Any) -> Splice | None:
    """The tail read of a split plan, started (None: its tier cannot be read apart)."""
    tail = [(m, t) for m, t in zip(match.blocks, match.tiers, strict=True)
            if plan.split <= m.start < plan.end]
    cache = req.ctx.cache
    tier = {t.name: t for t in getattr(cache, "lower", ())}.get(tail[0][1]) if tail else None
    adapter = getattr(cache, "adapter", None)
    if tier is None or req.ns is None or adapter is None \
            or getattr(tier, "get_many", None) is None:
        return None
    metas = [m for m, _ in tail]
    return Splice(str(tier.name), metas, plan.split, plan.end, plan.split_s or 0.0,
                  plan.overlap, functools.partial(read_tail, tier, metas, req.ns,
                                                  Payloads(adapter)))


def read_tail(tier: Any, metas: Sequence[BlockMeta], ns: Namespace,
              payloads: Payloads) -> list[tuple[Any, int] | None]:
    """On the background thread: the tail's bytes in one ``get_many``, made into payloads
    as a promotion makes them (``Payloads.load_many``: each buffer decoded in place, a
    mapped segment's or Redis's bytes not copied first), so the read's time means what
    the load path's does. Each block's ``(payload, nbytes)``, or None (absent, another
    block's, unreadable)."""
    got = list(tier.get_many([m.block_hash for m in metas], ns=ns))
    if len(got) != len(metas):
        raise TierError("get_many returned a wrong number of blocks")
    present = [k for k, g in enumerate(got) if isinstance(g, tuple) and len(g) == 2
               and isinstance(g[0], (bytes, bytearray, memoryview))]
    view_ok = getattr(payloads.adapter, "copies_buffers", False)
    loaded = payloads.load_many([(got[k][0] if view_ok else bytes(got[k][0]),
                                  metas[k].block_hash) for k in present])
    out: list[tuple[Any, int] | None] = [None] * len(metas)
    for k, res in zip(present, loaded, strict=True):
        out[k] = res if isinstance(res, tuple) else None
    return out


def _timed(req: SavingRow, sp: Splice) -> None:
    """The split's measured seconds against its plan's parts (``Rates.split``)."""
    if sp.overlap is not None:
        req.ctx.planner.rates.record_split(sp.tier_name, sp.overlap,
                                           time.perf_counter() - sp.started)


def splice_due(req: SavingRow) -> None:
    """At a chunk boundary past the split point (``req.splice``): splice the tail in
    once its read is done (waiting at most ``wait_s`` at the split point itself);
    give it up at the tail's end or when the read failed."""
    sp = req.splice
    if sp is None or req.pos < sp.at:
        return
    c = req.ctx.counters
    if req.pos >= sp.end:
        req.splice = None
        c.splices_given_up += 1
        _timed(req, sp)  # the tail prefilled: what this split cost
        return
    if not sp.future.done():
        if req.pos > sp.at:
            return  # still late: one more chunk prefilled
        try:
            sp.future.result(timeout=sp.wait_s)
        except Exception:  # late (or failed: seen below)
            pass
        if not sp.future.done():
            c.splices_late += 1
            return
    req.splice = None
    try:
        if _splice(req, sp):
            _timed(req, sp)
        else:
            c.splices_given_up += 1
    except Exception:
        logger.exception("splicing a request's tail blocks failed; prefilling them")
        c.splices_given_up += 1


def _splice(req: SavingRow, sp: Splice) -> bool:
    got, read_s = sp.future.result()
    pos = req.pos
    first = next((i for i, m in enumerate(sp.metas) if m.start == pos), None)
    if first is None:
        return False
    blocks: list[tuple[Any, Any]] = []
    nbytes = 0
    for meta, g in zip(sp.metas[first:], got[first:], strict=True):
        if g is None:
            break
        blocks.append((meta, g[0]))
        nbytes += meta.nbytes
    rates = req.ctx.planner.rates
    rates.record_read(sp.tier_name, 1, sum(m.nbytes for m in sp.metas), read_s)
    req.ctx.counters.rate_read_samples += 1
    if not blocks:
        return False
    n = min(blocks[-1][0].end, sp.end)
    t = time.perf_counter()
    head = adapters.extract_block(req.caches, 0, pos, False)
    tally = adapters.RestoreTally()
    req.caches = adapters.restore(req.ctx.model, [(BlockSpan(0, pos), head), *blocks], n,
                                  reserve=req.n_prompt - n + 1, tally=tally)
    rates.restore.add(len(blocks), nbytes, time.perf_counter() - t)
    c = req.ctx.counters
    c.splices += 1
    c.spliced_tokens += n - pos
    c.restore_copies += tally.copies
    c.restore_copy_bytes += tally.bytes
    req.pos = n
    u = req.usage
    u.cached_tokens += n - pos
    u.recomputed_tokens -= n - pos
    u.cached_by_tier[sp.tier_name] = u.cached_by_tier.get(sp.tier_name, 0) + n - pos
    return True
