"""Partial tail blocks that a longer sibling covers are not kept twice."""

from core_helpers import BYTES_PER_TOKEN, PayloadRecorder, make_cache, ns_of, payload_for

NS = ns_of(4)
PROMPT = list(range(1, 11))  # blocks [1..4] [5..8] and a partial tail [9, 10]
TURN = PROMPT + [11, 12, 13]  # prompt + output: [9..12] full and a partial [13]


def test_end_of_generation_block_supersedes_the_prompt_tail():
    cache = make_cache()
    assert cache.store(NS, PROMPT, 10, payload_for, session_id="s", save_point="end_prefill") == 3
    assert cache.stats().ram_bytes == 10 * BYTES_PER_TOKEN + 4  # + the tail snapshot array
    assert cache.store(NS, TURN, 13, payload_for, session_id="s", save_point="end_generation") == 2
    s = cache.stats()
    # [9, 10] is gone: 12 tokens in full blocks + the 1-token tail
    assert (s.superseded, s.ram_blocks, s.ram_bytes) == (1, 4, 13 * BYTES_PER_TOKEN + 4)
    # the prompt alone still restores 9 tokens (last one recomputed), through [9..12]
    m = cache.lookup(PROMPT, NS)
    assert m.num_tokens == 9 and [b.token_ids for b in m.blocks][-1] == (9, 10, 11, 12)
    # a diverging continuation uses the longest common prefix of the longer block
    assert cache.lookup(PROMPT + [99, 100], NS).num_tokens == 10
    cache.check()


def test_a_covered_partial_is_not_stored_again():
    cache = make_cache()
    cache.store(NS, TURN, 13, payload_for)
    rec = PayloadRecorder()
    assert cache.store(NS, PROMPT, 10, rec, session_id="late") == 0
    assert rec.calls == []  # [9, 10] is covered by [9..12]: no payload asked for
    assert cache.stats().ram_bytes == 13 * BYTES_PER_TOKEN + 4
    # the covering block records the session, so deleting it removes the block
    assert cache.delete_session("late") >= 1
    cache.check()


def test_referenced_or_non_truncatable_tails_stay():
    cache = make_cache()
    cache.store(NS, PROMPT, 10, payload_for)
    hit = cache.acquire(PROMPT + [42], NS)  # holds [9, 10]
    assert hit.num_tokens == 10
    cache.store(NS, TURN, 13, payload_for)
    assert cache.stats().superseded == 0 and cache.stats().ram_blocks == 5
    cache.release(hit)
    # snapshots are needed at the tail's end for states that cannot be truncated
    hybrid = make_cache()
    hybrid.store(NS, PROMPT, 10, payload_for, truncatable=False)
    hybrid.store(NS, TURN, 13, payload_for, truncatable=False)
    assert hybrid.stats().superseded == 0 and hybrid.lookup(PROMPT + [42], NS).num_tokens == 10
