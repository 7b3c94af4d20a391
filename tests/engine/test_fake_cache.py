"""The engine's request path depends on a cache Protocol (``engine/cache_like.py``
``RequestCache``), not on ``PromptCache``: a fake cache stands in."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from conftest import BLOCK
from stepper import Stepper

from promptcache.cache.types import ChainCursor, Hit, Match
from promptcache.engine.payload.blockbuf import BlockPayload
from promptcache.meta import ExtraKeySpan, Namespace


class FakeCache:
    """Never hits; keeps the payload of every full block it is asked to store."""

    def __init__(self) -> None:
        self.acquired: list[tuple[int, ...]] = []
        self.released = 0
        self.saves: list[tuple[str, int]] = []  # (save point, tokens)
        self.blocks: dict[tuple[int, int], Any] = {}
        self.adapter = None  # no lower tier: nothing to splice

    def lookup(self, tokens: Any, ns: Namespace, extra_keys: Sequence[ExtraKeySpan] = (),
               explain: bool = False) -> Match:
        return Match([], 0, 0, None)

    def acquire(self, tokens: Any, ns: Namespace, extra_keys: Sequence[ExtraKeySpan] = (),
                session_id: str | None = None, plan: Any = None) -> Hit:
        self.acquired.append(tuple(int(t) for t in tokens))
        return Hit([], 0, len(tokens), {}, [], None)

    def release(self, hit: Hit) -> None:
        self.released += 1

    def store(self, ns: Namespace, tokens: Any, num_tokens: int,
              payload_for: Callable[[int, int, bool], Any], *,
              extra_keys: Sequence[ExtraKeySpan] = (), session_id: str | None = None,
              agent_id: str | None = None, truncatable: bool = True,
              snapshot_at_end: bool = True, include_partial: bool = True,
              save_point: str = "mid_prefill", cursor: ChainCursor | None = None) -> int:
        self.saves.append((save_point, num_tokens))
        created = 0
        for start in range(0, num_tokens // BLOCK * BLOCK, BLOCK):
            if (start, start + BLOCK) not in self.blocks:
                self.blocks[start, start + BLOCK] = payload_for(start, start + BLOCK, False)
                created += 1
        return created


def test_a_fake_cache_stands_in_for_the_prompt_cache(tiny_llama_path: Any,
                                                     engine_factory: Any) -> None:
    """A request runs over a fake cache: its tokens are those the real cache gives, and
    the fake sees one acquire, one release and saves whose blocks hold the prompt and
    the output but its last token."""
    fake = FakeCache()
    eng = engine_factory(tiny_llama_path)
    prompt = [int(t) for t in np.random.default_rng(7).integers(3, 1000, size=30)]
    real = Stepper(eng)
    want = real.submit(prompt, max_tokens=6)
    real.run()
    st = Stepper(eng)
    st.ctx.cache = fake
    got = st.submit(prompt, max_tokens=6)
    st.run()
    assert got.result is not None and want.result is not None
    assert got.tokens == want.tokens and len(got.tokens) == 6
    assert fake.acquired == [tuple(prompt)] and fake.released == 1
    assert [p for p, _ in fake.saves][-2:] == ["end_prefill", "end_generation"]
    # prompt + output[:-1] = 35 tokens: 4 full blocks
    assert sorted(fake.blocks) == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert all(isinstance(p, BlockPayload) for p in fake.blocks.values())
    u = got.result.usage
    assert u.cached_tokens == 0
    assert u.saved_mid_prefill + u.saved_end_prefill + u.saved_end_generation == 4
