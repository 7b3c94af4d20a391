"""Speculative decoding drafted from history (``--speculation suffix``).

A decode step of a request whose draft source (``drafts.SequenceDrafts``: its own
prompt + output) proposes ``d1..dm`` feeds ``[t, d1..dm]`` in ONE forward (``t``: the
token sampled last) and keeps the longest prefix of the draft that greedy decoding
would have produced (``argmax`` at each position equals the next draft token), plus the
model's own token after it: 1 + accepted tokens per forward, exactly the tokens
decoding one at a time gives. The cache's rejected positions are trimmed.

With sampling (temperature > 0) each position is sampled in order with the request's own
key (split once per sample, as when decoding one token at a time) and a draft token is
accepted only if it equals that sample: the same tokens for the same seed, the
distribution unchanged.

Where it runs (``Speculator.eligible``), today: a batch of ONE row (one stream: the
agentic client's common case), greedy or sampled, no logits processors (constraints), no
log-probabilities, plain KV caches (every layer trimmable: no sliding window, no array /
SSM state, no quantized KV), no logits hook. Everything else decodes as before. The
number of draft tokens adapts per request (doubles after a fully accepted draft, falls
to accepted + 1 after a rejection, at least ``MIN_K``), so a request whose drafts keep
failing costs at most a few positions more per forward.

``Speculator.source`` replaces the draft source (tests: drafts that are right, wrong or
half right must all give the same tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..config import EngineConfig
from . import mlx_compat
from .drafts import DraftConfig, SequenceDrafts

if TYPE_CHECKING:
    from .request import EngineCounters, Request

# (request, k) -> up to k draft tokens following the request's sequence
DraftSource = Callable[["Request", int], Sequence[int]]

MIN_K = 2
# history indexed per request: the last this many tokens of prompt + output
HISTORY_TOKENS = 32768


class Speculator:
    def __init__(self, config: EngineConfig, counters: EngineCounters,
                 source: DraftSource | None = None) -> None:
        self.max_k = config.spec_max_draft
        self.drafts_config = DraftConfig(min_n=config.spec_min_match,
                                         max_n=max(config.spec_min_match, 8),
                                         max_k=config.spec_max_draft)
        self.counters = counters
        self.source = source
        # request id -> (where its indexed history starts, the index)
        self._index: dict[str, tuple[int, SequenceDrafts]] = {}
        self._k: dict[str, int] = {}

    def eligible(self, rows: Sequence[Request], cache: Sequence[Any]) -> bool:
        if len(rows) != 1:
            return False
        r = rows[0]
        return (not r.processors and not r.sampler.wants_logprobs
                and r.ctx.logits_hook is None and r.truncatable and not r.sliding
                and mlx_compat.plain_batch_kv(cache))

    def propose(self, r: Request) -> tuple[int, ...]:
        """Draft tokens after ``r``'s sequence (prompt + output so far)."""
        k = self._k.setdefault(r.request_id, max(MIN_K, self.max_k // 2))
        if self.source is not None:
            return tuple(int(t) for t in self.source(r, k))[:k]
        n = r.n_prompt + len(r.output)
        entry = self._index.get(r.request_id)
        if entry is None:
            start = max(0, n - HISTORY_TOKENS)
            entry = self._index[r.request_id] = (start, SequenceDrafts(
                (int(t) for t in r.seq[start:n].tolist()), self.drafts_config))
        base, index = entry
        have = base + len(index)
        if have < n:
            index.extend(int(t) for t in r.seq[have:n].tolist())
        return index.propose(k).tokens

    def feedback(self, r: Request, drafted: int, accepted: int) -> None:
        c = self.counters
        c.spec_verifies += 1
        c.spec_drafted += drafted
        c.spec_accepted += accepted
        k = self._k.get(r.request_id, self.max_k)
        self._k[r.request_id] = min(self.max_k, 2 * k) if accepted == drafted \
            else max(MIN_K, accepted + 1)

    def forget(self, r: Request) -> None:
        self._index.pop(r.request_id, None)
        self._k.pop(r.request_id, None)
