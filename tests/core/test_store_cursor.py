"""PromptCache.store(..., cursor=): saves of a growing sequence hash only their new blocks
and store exactly what a save from the root stores."""

from __future__ import annotations

import numpy as np
import pytest
from core_helpers import PayloadRecorder, make_cache, ns_of

from promptcache.cache import ChainCursor, matcher

NS = ns_of(4)


def _blocks(cache):
    return sorted((b.start, b.num_tokens, b.block_hash, b.flags) for b in cache.pool.blocks())


class _CountingHash:
    def __init__(self, monkeypatch):
        self.calls = 0
        real = matcher.block_hash

        def counted(parent, token_ids, extra):
            self.calls += 1
            return real(parent, token_ids, extra)

        monkeypatch.setattr(matcher, "block_hash", counted)


@pytest.mark.parametrize("truncatable", [True, False])
def test_chunked_saves_with_a_cursor_equal_saves_from_the_root(truncatable):
    seq = list(range(100, 150))  # 12 full blocks of 4 + a partial of 2
    plain, cursored = make_cache(), make_cache()
    rec_plain, rec_cur = PayloadRecorder(), PayloadRecorder()
    cur = ChainCursor(NS)
    for end in (8, 16, 24, 48):  # mid-prefill chunks: full blocks only
        kw = {"truncatable": truncatable, "include_partial": False, "save_point": "mid_prefill"}
        a = plain.store(NS, seq, end, rec_plain, **kw)
        b = cursored.store(NS, seq, end, rec_cur, cursor=cur, **kw)
        assert a == b
        assert cur.start == end
    kw = {"truncatable": truncatable, "include_partial": True, "save_point": "end_prefill"}
    assert plain.store(NS, seq, 50, rec_plain, **kw) == cursored.store(NS, seq, 50, rec_cur,
                                                                       cursor=cur, **kw) == 1
    assert cur.start == 48  # the partial tail [48, 50) is re-walked by the next save
    assert rec_plain.calls == rec_cur.calls
    assert _blocks(plain) == _blocks(cursored)
    assert cursored.lookup(seq + [7], NS).num_tokens == plain.lookup(seq + [7], NS).num_tokens
    cursored.check()


def test_a_cursor_hashes_each_block_once(monkeypatch):
    counter = _CountingHash(monkeypatch)
    cache = make_cache(budget=1 << 24)
    seq = list(range(1, 4 * 512 + 1))  # 512 blocks saved in 128 chunks of 4 blocks
    cur = ChainCursor(NS)
    for end in range(16, len(seq) + 1, 16):
        cache.store(NS, seq, end, lambda s, e, snap: {"0.k": np.zeros((e - s, 2), np.float32)},
                    include_partial=False, cursor=cur)
    assert counter.calls == 512
    counter.calls = 0
    again = make_cache(budget=1 << 24)
    for end in range(16, len(seq) + 1, 16):  # from the root: 4 + 8 + ... + 512 blocks
        again.store(NS, seq, end, lambda s, e, snap: {"0.k": np.zeros((e - s, 2), np.float32)},
                    include_partial=False)
    assert counter.calls == sum(range(4, 513, 4))


def test_end_of_generation_supersedes_the_partial_tail_through_the_cursor():
    cache = make_cache()
    prompt = list(range(10, 20))  # [0,4) [4,8) + partial [8,10)
    cur = ChainCursor(NS)
    assert cache.store(NS, prompt, 10, PayloadRecorder(), cursor=cur, save_point="end_prefill") == 3
    assert cur.start == 8
    seq = prompt + [30, 31, 32, 33]
    rec = PayloadRecorder()
    assert cache.store(NS, seq, 13, rec, cursor=cur, save_point="end_generation") == 2
    assert rec.calls == [(8, 12, False), (12, 13, True)]
    assert cur.start == 12
    assert sorted((b.start, b.num_tokens) for b in cache.pool.blocks()) == [
        (0, 4), (4, 4), (8, 4), (12, 1)]  # the partial [8, 10) was superseded
    assert cache.lookup(seq + [1], NS).num_tokens == 13


def test_cursor_after_a_hit_starts_behind_its_full_blocks():
    cache = make_cache()
    seq = list(range(50, 61))  # 11 tokens: [0,4) [4,8) [8,11)
    cache.store(NS, seq, 11, PayloadRecorder())
    hit = cache.acquire(seq[:10] + [99, 98, 97], NS)
    assert hit.num_tokens == 10
    cur = ChainCursor.after_hit(NS, [m for m, _ in hit.blocks], hit.num_tokens)
    cache.release(hit)
    assert cur.start == 8 and cur.parent == hit.blocks[1][0].block_hash
    rec = PayloadRecorder()
    longer = seq[:10] + [99, 98, 97]
    assert cache.store(NS, longer, 13, rec, cursor=cur) == 2
    assert rec.calls == [(8, 12, False), (12, 13, True)]
    assert cache.lookup(longer + [1], NS).num_tokens == 13


def test_cursor_bad_input():
    cache = make_cache()
    with pytest.raises(ValueError, match="multiple of the block size"):
        ChainCursor(NS, 3, b"x" * 32)
    with pytest.raises(ValueError, match="parent hash exactly when"):
        ChainCursor(NS, 4)
    with pytest.raises(ValueError, match="same namespace"):
        cache.store(NS, [1, 2, 3, 4], 4, PayloadRecorder(), cursor=ChainCursor(ns_of(4, "t2")))
    cur = ChainCursor(NS)
    cache.store(NS, list(range(1, 9)), 8, PayloadRecorder(), cursor=cur)
    with pytest.raises(ValueError, match="past num_tokens"):
        cache.store(NS, list(range(1, 9)), 4, PayloadRecorder(), cursor=cur)
    # nothing new: a no-op that still counts the save
    assert cache.store(NS, list(range(1, 9)), 8, PayloadRecorder(), cursor=cur) == 0


def test_note_not_stored_explains_the_next_miss():
    """A failed save's cause (``note_not_stored``) is the next lookup's miss cause where
    the stored chain stops: the first unsaved full block, or a partial tail behind a
    stored block; never the namespace root for a partial prompt (a cold start stays cold)."""
    cache = make_cache()
    seq = list(range(200, 214))  # 3 full blocks of 4 + a partial of 2
    cache.note_not_stored(NS, np.array(seq, np.uint32), 14, ChainCursor(NS), "layout")
    assert cache.lookup(seq, NS).miss.cause == "not_stored: layout"
    assert cache.lookup(list(range(300, 314)), NS).miss.cause == "cold"
    cur = ChainCursor(NS)
    cache.store(NS, seq, 12, PayloadRecorder(), include_partial=False, cursor=cur)
    assert cur.start == 12
    cache.note_not_stored(NS, seq, 14, cur, "tier")  # the partial tail [12, 14) failed
    miss = cache.lookup(seq + [9], NS).miss
    assert (miss.cause, miss.position, miss.restorable) == ("not_stored: tier", 12, 12)
    short = list(range(400, 403))  # shorter than a block: nothing to key it by but the root
    fresh = make_cache()
    fresh.note_not_stored(NS, short, 3, ChainCursor(NS), "other")
    assert fresh.lookup(short + [1], NS).miss.cause == "cold"
    with pytest.raises(ValueError):
        cache.note_not_stored(NS, seq, 14, None, "")
