"""What the speculator keeps per request besides its gate: the request's own draft
index with its copy cursor (``RowIndexes``), the drafts that fill a verify's padding
(``Fills``), and the speculation stats (``spec_stats``).

- ``RowIndexes``: each request's ``drafts.SequenceDrafts`` over the last
  ``HISTORY_TOKENS`` of its prompt + output, extended as tokens are generated; when a
  draft from the request's own sequence is verified, the index's copy cursor moves to
  where it stopped being accepted (``drafts``: a reply that leaves the copy at a change
  comes back to it a few tokens later).
- ``Fills``: a verify forward is as wide as its longest draft; every other row is
  padded to that width with its pending token, positions computed for nothing. A row
  that drafts nothing this step (cooling down after a rejected draft, paused because
  its drafts did not pay, looking less often, or whose draft the gate dropped) gets its
  best draft there instead (``Speculator.fill``): it costs nothing the forward does not
  already compute. The gate counts a fill's tokens at the fills' own acceptance rate
  (engine-wide, decayed, prior 1/3); a fill changes no row's draft length, cool-down
  or pause, except that an accepted fill ends the row's cool-down (its copy is back in
  sync). A row whose own draft (``k`` long) is shorter than the verify goes on there
  the same way: its draft is looked up ``max_k`` long and fed up to the verify's width
  (``Speculator.plan``); the row's rate, k and cool-down count its first ``k`` tokens,
  the rest counts as a fill. Counted in ``spec_drafted`` / ``spec_accepted`` and apart
  in ``spec_fill_drafted`` / ``spec_fill_accepted``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .drafts import DraftConfig, SequenceDrafts
from .spec_cost import Acceptance

if TYPE_CHECKING:
    from .context import EngineCounters
    from .request import Request
    from .speculate import Speculator

# history indexed per request: the last this many tokens of prompt + output
HISTORY_TOKENS = 32768
# the fills' acceptance before any was verified: 1 accepted, 2 rejected
FILL_PRIOR = (1.0, 2.0)


class RowIndexes:
    """Each request's own n-gram index and where its last draft started (engine thread)."""

    def __init__(self, config: DraftConfig) -> None:
        self.config = config
        # request id -> (where its indexed history starts, the index)
        self._index: dict[str, tuple[int, SequenceDrafts]] = {}
        # request id -> where in its own index its last draft starts (-1: elsewhere)
        self._at: dict[str, int] = {}

    def synced(self, r: Request) -> SequenceDrafts:
        """``r``'s index, holding its sequence (prompt + output) so far."""
        n = r.n_prompt + len(r.output)
        entry = self._index.get(r.request_id)
        if entry is None:
            start = max(0, n - HISTORY_TOKENS)
            entry = self._index[r.request_id] = (start, SequenceDrafts(
                (int(t) for t in r.seq[start:n].tolist()), self.config))
        base, index = entry
        have = base + len(index)
        if have < n:
            index.extend(int(t) for t in r.seq[have:n].tolist())
        return index

    def drafted(self, request_id: str, at: int) -> None:
        """The request's draft this step starts at ``at`` of its index (-1: elsewhere)."""
        self._at[request_id] = at

    def verified(self, request_id: str, accepted: int) -> None:
        """Its draft had ``accepted`` tokens accepted: the copy cursor goes there."""
        at = self._at.pop(request_id, -1)
        entry = self._index.get(request_id)
        if at >= 0 and entry is not None:
            entry[1].cursor = at + accepted

    def forget(self, request_id: str) -> None:
        self._index.pop(request_id, None)
        self._at.pop(request_id, None)


class Fills:
    """The rows whose draft this step is a fill, and the fills' acceptance."""

    def __init__(self) -> None:
        self.rows: set[str] = set()
        self.acceptance = Acceptance(*FILL_PRIOR)

    @property
    def rate(self) -> float:
        return self.acceptance.rate

    def verified(self, r: Request, c: EngineCounters, drafted: int, accepted: int) -> bool:
        """Count a verified draft of ``r`` if it was a fill (True), else nothing."""
        if r.request_id not in self.rows:
            return False
        self.rows.discard(r.request_id)
        self.count(r, c, drafted, accepted)
        self.acceptance.update(drafted, accepted)
        return True

    @staticmethod
    def count(r: Request, c: EngineCounters, drafted: int, accepted: int) -> None:
        """Fill tokens verified for ``r``: the engine's fill counters and the request's usage."""
        c.spec_fill_drafted += drafted
        c.spec_fill_accepted += accepted
        r.usage.spec_drafted += drafted
        r.usage.spec_accepted += accepted


def spec_stats(spec: Speculator | None, c: EngineCounters) -> dict[str, Any]:
    """The draft pool's size and what the speculation counters mean (``engine_stats``):
    acceptance rate (accepted / drafted), mean accepted length (accepted / verify
    forwards) and tokens per verify forward (1 + that: the model's own token after
    each draft)."""
    v, d, a = c.spec_verifies, c.spec_drafted, c.spec_accepted
    relative = ({f"k{k}": round(spec.cost.relative(1, k + 1), 3) for k in (1, 2, 4, 8, 16)}
                if spec is not None else {})
    return {"spec_pool_tokens": spec.pool_tokens() if spec is not None else 0,
            # one stream's verify forward of k drafts, in decode steps
            "spec_verify_cost": relative,
            "spec_pool_ngrams": spec.pools.num_ngrams() if spec is not None else 0,
            "spec_acceptance_rate": round(a / d, 4) if d else None,
            "spec_mean_accepted": round(a / v, 4) if v else None,
            "spec_tokens_per_forward": round(1 + a / v, 4) if v else None}
