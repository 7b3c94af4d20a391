"""What speculation keeps: a request as it sees it (``Row``), a request's own state
(``RowState``), the fills' acceptance (``Fills``) and its counters (``SpecCounters``).
docs/architecture.md says how they are used."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from ..api import GenerationRequest, Usage
from ..sampling import Sampler
from .drafts import DraftConfig, SequenceDrafts
from .gate import Acceptance

# history indexed per request: the last this many tokens of prompt + output
HISTORY_TOKENS = 32768
# the fills' acceptance before any was verified: 1 accepted, 2 rejected
FILL_PRIOR = (1.0, 2.0)

Processor = Callable[[mx.array, mx.array], mx.array]


class HasHook(Protocol):
    @property
    def logits_hook(self) -> object | None: ...


class Row(Protocol):
    """A decoding request as speculation sees it (``engine.requests.request.Request``)."""

    pos: int
    sliding: bool

    @property
    def request_id(self) -> str: ...
    @property
    def req(self) -> GenerationRequest: ...
    @property
    def ctx(self) -> HasHook: ...
    @property
    def output(self) -> list[int]: ...
    @property
    def n_prompt(self) -> int: ...
    @property
    def seq(self) -> np.ndarray: ...
    @property
    def sampler(self) -> Sampler: ...
    @property
    def processors(self) -> Sequence[Processor]: ...
    @property
    def usage(self) -> Usage: ...

    def process(self, logits: mx.array, fed: mx.array | None) -> mx.array: ...

    def accept(self, tok: int, lp: tuple[float, tuple[tuple[int, float], ...]] | None,
               logits: mx.array | None = None) -> str | None: ...

    def finish(self, reason: str, caches: Sequence[Any] | None = None, *,
               state_pos: int | None = None, error: str | None = None) -> None: ...

    def store_decoded_block(self, caches: Sequence[Any]) -> None: ...


@dataclass
class RowState:
    """One request's speculation state; it goes when the request finishes."""

    k: int | None = None  # draft tokens it asks for (None: not drafted yet)
    acc: Acceptance | None = None  # its decayed acceptance (from the engine's recent rate)
    cool: tuple[int, int] = (0, 0)  # steps left without drafts, the last cool-down's length
    pause: tuple[int, int] = (0, 0)  # the same for a pause after drafts that did not pay
    probing: bool = False  # its pause ran out: its next draft probes
    source: str = ""  # where its last draft came from: self | pool | source
    empty: int = 0  # proposals in a row that found nothing
    skip: int = 0  # steps left without looking
    fill: bool = False  # its draft this step is a fill
    more: tuple[int, ...] = ()  # its draft this step looked up max_k long, where longer
    extended: int | None = None  # its own length, when its verified draft was extended
    index: SequenceDrafts | None = None  # its own n-gram index ...
    start: int = 0  # ... over its sequence from here
    at: int = -1  # where in its index its last draft starts (-1: elsewhere)

    def waits(self) -> bool:
        return self.cool[0] > 0 or self.pause[0] > 0 or self.skip > 0

    def tick(self) -> bool:
        """One step of its cool-down, pause or skip passes; True if it was in one."""
        if self.cool[0] > 0:
            self.cool = (self.cool[0] - 1, self.cool[1])
            return True
        if self.pause[0] > 0:
            self.pause = (self.pause[0] - 1, self.pause[1])
            self.probing = self.probing or self.pause[0] == 0
            return True
        if self.skip > 0:
            self.skip -= 1
            return True
        return False

    def synced(self, r: Row, config: DraftConfig) -> SequenceDrafts:
        """Its index, holding its sequence (prompt + output) so far."""
        n = r.n_prompt + len(r.output)
        if self.index is None:
            self.start = max(0, n - HISTORY_TOKENS)
            self.index = SequenceDrafts((int(t) for t in r.seq[self.start:n].tolist()), config)
        have = self.start + len(self.index)
        if have < n:
            self.index.extend(int(t) for t in r.seq[have:n].tolist())
        return self.index

    def verified(self, accepted: int) -> None:
        """Its draft had ``accepted`` tokens accepted: the copy cursor goes there."""
        at, self.at = self.at, -1
        if at >= 0 and self.index is not None:
            self.index.cursor = at + accepted


@dataclass
class SpecCounters:
    """Speculation's counters (reported through ``engine_stats``)."""

    spec_verifies: int = 0  # verify forwards
    spec_drafted: int = 0  # draft tokens fed
    spec_accepted: int = 0  # ... and accepted
    spec_pool_drafted: int = 0  # of those, drafts from the tenant's pool
    spec_pool_accepted: int = 0
    # drafts of rows that drafted nothing themselves, in positions a verify pads anyway
    # (included in spec_drafted / spec_accepted)
    spec_fill_drafted: int = 0
    spec_fill_accepted: int = 0
    spec_pool_seeded: int = 0  # tokens the pools took from the cache's stored token ids
    spec_recomputes: int = 0  # forwards that fed accepted tokens again (array states)
    spec_multirow: int = 0  # verify forwards over several rows
    spec_gated: int = 0  # steps with drafts where the gate decoded as usual
    spec_presync_gated: int = 0  # ... decided before the pending tokens were read
    spec_paused: int = 0  # rows whose drafts did not pay: paused, then probed again
    spec_guard_off: int = 0  # batch sizes the guard turned speculation off for
    spec_grammar_cut: int = 0  # draft tokens of constrained rows the grammar rejects
    # rows of a uniform batch (array states) that stopped inside a draft: not stored
    spec_unsaved: int = 0


class Fills:
    """The fills' acceptance (engine-wide, decayed, prior 1/3)."""

    def __init__(self) -> None:
        self.acceptance = Acceptance(*FILL_PRIOR)

    @property
    def rate(self) -> float:
        return self.acceptance.rate

    @staticmethod
    def count(r: Row, c: SpecCounters, drafted: int, accepted: int) -> None:
        """Fill tokens verified for ``r``: the fill counters and the request's usage."""
        c.spec_fill_drafted += drafted
        c.spec_fill_accepted += accepted
        r.usage.spec_drafted += drafted
        r.usage.spec_accepted += accepted
