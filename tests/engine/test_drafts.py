"""Draft sources for speculative decoding (engine/speculation/drafts.py) against brute-force
references (Hypothesis), the pool's token budget, and tenant isolation."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from promptcache.engine.speculation.drafts import (
    NO_DRAFT,
    Draft,
    DraftConfig,
    DraftPools,
    SequenceDrafts,
    TenantDrafts,
    propose,
)

CFG = DraftConfig(min_n=2, max_n=4, max_k=5, pool_tokens=60)
tokens = st.lists(st.integers(0, 5), max_size=80)  # a small alphabet: many repeats


def reference(seqs: list[list[int]], tail: list[int], k: int, cfg: DraftConfig,
              own: bool) -> tuple[tuple[int, ...], int]:
    """Longest n first; the latest occurrence (sequences in order, positions in order)
    that something follows; never across two sequences; for ``own`` the tail itself
    (the sequence's end) is not an occurrence, and a draft that reaches the end repeats
    the span from its start (the sequence's token ``at + i mod (end - at)``)."""
    end = len(tail)
    for n in range(min(cfg.max_n, end), cfg.min_n - 1, -1):
        gram = tail[end - n:]
        best: tuple[int, ...] | None = None
        for seq in seqs:
            for j in range(len(seq) - n):
                if seq[j:j + n] == gram:
                    at = j + n
                    best = tuple(seq[at + i % (len(seq) - at)] for i in range(k)) if own \
                        else tuple(seq[at:at + k])
        if best:
            return best, n
    return (), 0


@settings(max_examples=150, deadline=None)
@given(tokens, st.integers(1, 8))
def test_own_sequence_matches_the_reference(seq: list[int], k: int) -> None:
    d = SequenceDrafts(seq, CFG)
    got = d.propose(k)
    want, n = reference([seq], seq, min(k, CFG.max_k), CFG, own=True)
    assert (got.tokens, got.matched) == (want, n)
    assert got.source == ("self" if want else "")


@settings(max_examples=200, deadline=None)
@given(tokens, st.lists(st.integers(0, 5), max_size=10))
def test_appending_equals_building_at_once(seq: list[int], more: list[int]) -> None:
    a = SequenceDrafts(seq, CFG)
    a.extend(more)
    b = SequenceDrafts(seq + more, CFG)
    assert a.propose(5) == b.propose(5)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=30), max_size=6),
       st.lists(st.integers(0, 5), max_size=8), st.integers(1, 8))
def test_pool_matches_the_reference_over_kept_sequences(seqs: list[list[int]],
                                                        tail: list[int], k: int) -> None:
    pool = TenantDrafts(CFG)
    for s in seqs:
        pool.add(s)
    # kept: the newest sequences whose total fits the budget (each cut to the budget)
    kept: list[list[int]] = []
    total = 0
    for s in reversed([s[-CFG.pool_tokens:] for s in seqs]):
        if total + len(s) > CFG.pool_tokens:
            break
        kept.insert(0, s)
        total += len(s)
    assert pool.num_tokens == total
    # the index holds exactly the kept sequences' n-grams (none of the dropped ones)
    assert pool.num_ngrams == len({tuple(s[i - n:i]) for s in kept for i in range(len(s))
                                   for n in range(CFG.min_n, min(CFG.max_n, i) + 1)})
    got = pool.propose(tail, k)
    want, n = reference(kept, tail, min(k, CFG.max_k), CFG, own=False)
    assert (got.tokens, got.matched) == (want, n)


def test_the_index_forgets_the_ngrams_of_evicted_sequences() -> None:
    # its memory follows the pool's: 10 sequences of 30 through a 60-token pool leave the
    # n-grams of the last two only (they were 441 entries, stale ones rebuilt away only
    # past 4x the live size: the resident memory went up and down in steps)
    rng = random.Random(1)
    pool = TenantDrafts(CFG)
    seqs = [[rng.randrange(6) for _ in range(30)] for _ in range(10)]
    for seq in seqs:
        pool.add(seq)
    kept = seqs[-2:]
    live = {tuple(s[i - n:i]) for s in kept for i in range(len(s))
            for n in range(CFG.min_n, min(CFG.max_n, i) + 1)}
    assert pool.num_tokens == 60 and pool.num_ngrams == len(live) == 135


def test_pool_budget_evicts_oldest_sequences_whole() -> None:
    pool = TenantDrafts(DraftConfig(min_n=2, max_n=3, max_k=4, pool_tokens=10))
    pool.add([1, 2, 3, 4, 5, 6])
    pool.add([7, 8, 9])
    assert pool.num_tokens == 9
    assert pool.propose([1, 2], 4).tokens == (3, 4, 5, 6)
    pool.add([10, 11, 12])  # 12 > 10: the first sequence goes
    assert pool.num_tokens == 6
    assert pool.propose([1, 2], 4) == NO_DRAFT
    assert pool.propose([7, 8], 4).tokens == (9,)  # never into the next sequence


def test_own_history_first_then_the_tenants_pool_never_another_tenants() -> None:
    pools = DraftPools(CFG)
    pools.pool("alice").add([1, 2, 3, 4, 5])
    mine = SequenceDrafts([9, 9, 1, 2], CFG)
    assert propose(mine, pools.pool("alice"), 3).tokens == (3, 4, 5)
    assert propose(mine, pools.pool("bob"), 3) == NO_DRAFT  # bob never sees alice's text
    own = SequenceDrafts([1, 2, 7, 7, 1, 2], CFG)
    d = propose(own, pools.pool("alice"), 3)
    assert (d.tokens, d.source) == ((7, 7, 1), "self")
    assert pools.num_tokens() == 5


def resync_reference(seq: list[int], cursor: int, k: int, cfg: DraftConfig
                     ) -> tuple[tuple[int, ...], int, int]:
    """Every position j in [cursor, cursor + window) with something after it and before
    the tail: the tokens before j that equal the tail's last ones (at most max_n); the
    longest (at least cursor_min_n) wins, the earliest of those; its draft repeats the
    span from j when it reaches the end (as ``reference``)."""
    best: tuple[tuple[int, ...], int, int] = ((), 0, -1)
    end = len(seq)
    for j in range(max(1, cursor), min(end - 1, cursor + cfg.cursor_window)):
        n = 0
        while n < min(cfg.max_n, j) and seq[j - 1 - n] == seq[end - 1 - n]:
            n += 1
        if n >= cfg.cursor_min_n and n > best[1]:
            best = (tuple(seq[j + i % (end - j)] for i in range(k)), n, j)
    return best


RESYNC = DraftConfig(min_n=2, max_n=4, max_k=5, cursor_window=6, cursor_min_n=1)


@settings(max_examples=300, deadline=None)
@given(tokens, st.integers(0, 80), st.integers(1, 8))
def test_resync_at_the_cursor_matches_the_reference(seq: list[int], cursor: int,
                                                    k: int) -> None:
    d = SequenceDrafts(seq, RESYNC)
    d.cursor = cursor
    got = d.resync(min(k, RESYNC.max_k))
    want, n, at = resync_reference(seq, cursor, min(k, RESYNC.max_k), RESYNC)
    assert (got.tokens, got.matched, got.at) == (want, n, at)
    # propose: the re-sync when there is one, else the index's latest occurrence
    full = d.propose(k)
    if want:
        assert full == got
    else:
        index = SequenceDrafts(seq, RESYNC).propose(k)
        assert (full.tokens, full.matched) == (index.tokens, index.matched)


def test_a_renamed_identifier_resyncs_at_the_cursor_not_at_the_latest_occurrence() -> None:
    """A file (10 .. 29, with OLD = 50 at 4 and 14), then an ask that says "60 25" and
    goes on 70 71 72; the reply copies the file with NEW = 60 for OLD and has just
    written the 25 after the second NEW. The index's latest occurrence of the tail
    (60, 25) is the ask's, which proposes 70 71 72; the cursor (where the last accepted
    draft stopped: the OLD at 14) finds the 25 after it and proposes the file's 26 27
    28."""
    cfg = DraftConfig(min_n=2, max_n=4, max_k=3, cursor_window=8, cursor_min_n=1)
    file = [10, 11, 12, 13, 50, 15, 16, 17, 18, 19, 20, 21, 22, 23, 50, 25, 26, 27, 28, 29]
    ask = [90, 60, 25, 70, 71, 72]
    reply = [10, 11, 12, 13, 60, 15, 16, 17, 18, 19, 20, 21, 22, 23, 60, 25]
    d = SequenceDrafts(file + ask + reply, cfg)
    assert d.propose(3) == Draft((70, 71, 72), 2, "self", 23)
    d.cursor = 14  # the draft (50, 25, ...) was rejected at the OLD
    assert d.propose(3) == Draft((26, 27, 28), 1, "self", 16)
    d.cursor = 30  # far from any 25: the window finds nothing, the index answers
    assert d.propose(3) == Draft((70, 71, 72), 2, "self", 23)


def test_self_drafts_say_where_they_start() -> None:
    d = SequenceDrafts([1, 2, 3, 4, 1, 2], CFG)
    assert d.propose(3) == Draft((3, 4, 1), 2, "self", 2)
    pool = TenantDrafts(CFG)
    pool.add([1, 2, 3])
    assert pool.propose([1, 2], 3).at == -1


@pytest.mark.parametrize("kw", [{"min_n": 0}, {"min_n": 3, "max_n": 2}, {"max_k": 0},
                                {"pool_tokens": -1}, {"cursor_window": -1},
                                {"cursor_min_n": 0}, {"cursor_min_n": 9}])
def test_bad_configs_are_refused(kw: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        DraftConfig(**kw)


def test_pools_together_stay_within_the_budget_least_recently_added_out() -> None:
    pools = DraftPools(CFG)  # pool_tokens=60 over all tenants
    pools.add("a", list(range(30)))
    pools.add("b", list(range(100, 130)))
    assert pools.num_tokens() == 60
    pools.add("a", list(range(200, 210)))  # "a" is now the latest: "b" leaves
    assert pools.num_tokens() == 40
    assert pools.get("b") is None
    a = pools.get("a")
    assert a is not None and a.propose([3, 4], 3).tokens == (5, 6, 7)
    pools.add("c", [])  # nothing to add: nothing created
    assert pools.get("c") is None
    assert DraftPools(DraftConfig(pool_tokens=0)).num_tokens() == 0


def test_a_draft_that_reaches_the_end_repeats_its_span() -> None:
    cfg = DraftConfig(min_n=2, max_n=4, max_k=8)
    assert SequenceDrafts([5, 6, 7, 1, 1, 1], cfg).propose(4).tokens == (1, 1, 1, 1)
    # the tail (2, 3, 1, 2) last occurred at 2..5: what followed it, [3, 1, 2], repeats
    loop = SequenceDrafts([9, 1, 2, 3, 1, 2, 3, 1, 2], cfg)
    assert loop.propose(5).tokens == (3, 1, 2, 3, 1)
    # the pool's sequences are other texts: no repeat past their end
    pool = TenantDrafts(cfg)
    pool.add([4, 1, 1, 1])
    assert pool.propose([7, 1, 1], 4).tokens == (1,)
