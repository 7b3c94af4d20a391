"""``PromptCache.store(..., agent_id=)``: the (sub)agent is recorded on the RAM blocks
a store creates or finds, next to the session; at most ``MAX_AGENTS_PER_BLOCK`` per
block; a superseded partial tail hands its agents to the longer block; bad ids are a
ValueError."""

from __future__ import annotations

import numpy as np
import pytest

from promptcache.blocks.pool import MAX_AGENTS_PER_BLOCK
from promptcache.cache import PromptCache
from promptcache.config import CacheConfig
from promptcache.meta import Namespace

BS = 4
NS = Namespace("agents-model", BS)


def payload_for(start: int, end: int, snapshot: bool) -> dict[str, np.ndarray]:
    return {"0.k": np.full((1, 1, end - start, 2), float(start), dtype=np.float32)}


def by_start(cache: PromptCache) -> list[tuple[int, int, tuple[str, ...], tuple[str, ...]]]:
    return sorted((b.start, b.end, b.sessions, b.agents) for b in cache.pool.blocks())


def make() -> PromptCache:
    return PromptCache(CacheConfig(block_size=BS, ram_budget_bytes=1 << 20))


def test_agents_on_created_and_found_blocks() -> None:
    cache = make()
    assert cache.store(NS, list(range(8)), 8, payload_for, session_id="s",
                       agent_id="main") == 2
    # a subagent shares the first block, then diverges
    assert cache.store(NS, [0, 1, 2, 3, 9, 9, 9, 9], 8, payload_for, session_id="s",
                       agent_id="sub-1") == 1
    # no agent: nothing added
    assert cache.store(NS, list(range(8)), 8, payload_for, session_id="s") == 0
    assert by_start(cache) == [
        (0, 4, ("s",), ("main", "sub-1")),
        (4, 8, ("s",), ("main",)),
        (4, 8, ("s",), ("sub-1",)),
    ]


def test_agents_per_block_are_bounded() -> None:
    cache = make()
    for i in range(MAX_AGENTS_PER_BLOCK + 3):
        cache.store(NS, [1, 2, 3, 4], 4, payload_for, agent_id=f"a{i}")
    [block] = cache.pool.blocks()
    assert block.agents == tuple(f"a{i}" for i in range(MAX_AGENTS_PER_BLOCK))
    assert block.sessions == ()


def test_a_superseded_tail_hands_over_its_agents() -> None:
    cache = make()
    cache.store(NS, [1, 2, 3, 4, 5, 6], 6, payload_for, agent_id="a")  # tail [5, 6]
    cache.store(NS, [1, 2, 3, 4, 5, 6, 7], 7, payload_for, agent_id="b")  # tail [5, 6, 7]
    # the longer tail: its own agent first, then the superseded tail's
    assert by_start(cache) == [(0, 4, (), ("a", "b")), (4, 7, (), ("b", "a"))]


@pytest.mark.parametrize("bad", ["", 7, b"x"])
def test_bad_agent_id_is_a_value_error(bad: object) -> None:
    cache = make()
    with pytest.raises(ValueError, match="agent_id"):
        cache.store(NS, [1, 2, 3, 4], 4, payload_for, agent_id=bad)  # type: ignore[arg-type]
    assert cache.pool.blocks() == []
