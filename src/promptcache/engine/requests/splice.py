"""Cake's split, run: a request's tail blocks are read from their tier on a background
thread (bytes into host memory, nothing else) while the engine thread prefills the head;
at a chunk boundary inside the tail, once the read is in, the engine thread makes the
payloads and restores head + tail into fresh caches. It never waits past a bound: a late
or failed read leaves the head prefilling on (the tail recomputed, the output the same).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from ... import codec
from ..payload import adapters
from ..payload.cache_kinds import BlockSpan
from ..payload.planner import Planner
from .row import SavingRow, Splice

logger = logging.getLogger(__name__)

def planner_for(policy: str, template: Sequence[Any], cache: Any) -> Planner:
    """The engine's planner: its model qualifies with plain or quantized KV (no state
    snapshot, no sliding window); it splits where every lower tier has ``get_many``."""
    return Planner(policy, adapters.is_truncatable(template)
                   and not adapters.has_sliding_window(template),
                   concurrent=cache is not None and all(
                       hasattr(t, "get_many") for t in getattr(cache, "lower", ())))


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
        if not _splice(req, sp):
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
    adapter = req.ctx.cache.adapter if req.ctx.cache is not None else None
    for meta, g in zip(sp.metas[first:], got[first:], strict=True):
        if adapter is None or not (isinstance(g, tuple) and len(g) == 2):
            break
        dec = codec.decode(bytes(g[0]))
        if dec.desc.meta.block_hash != meta.block_hash:
            break
        blocks.append((meta, adapter.from_buffer(dec.buffer, dec.desc.layout)))
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
