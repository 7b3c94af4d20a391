"""OpenAI ``prompt_cache_retention`` through the server on a real tiny engine over a
real SSD tier (one controllable clock): ``24h`` pins the chain's SSD blocks for a day
from the request (``pinned_until`` in the index), ``in_memory`` pins nothing and
never shortens an existing pin; the pinned chain survives an SSD eviction storm."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from real_engine import Clock, make_cache, tiny_engine

from promptcache.config import SSDConfig
from promptcache.hashing import BlockHash
from promptcache.server import create_app
from promptcache.serving_config import ServerConfig
from promptcache.tiers.ssd import SSDTier

BS = 8
DAY = 86400.0
SYSTEM = ("You are a careful agent. You read the files before you change them, you keep the "
          "style of the code around you, and you report what you did plainly.")
OTHER = ("You translate short texts into French and answer with the translation only, "
         "keeping names and numbers exactly as they are written.")


class Served:
    def __init__(self, path: Path, tmp: Path) -> None:
        self.clock = Clock(1_800_000_000.0)
        self.ssd = SSDTier(SSDConfig(path=tmp / "ssd", fsync=False), clock=self.clock,
                           sweep_interval_s=1e9)
        self.cache = make_cache(block_size=BS, clock=self.clock, lower=[self.ssd],
                                write_through=True)
        self.engine = tiny_engine(path, self.cache, block_size=BS, chunk=4 * BS)
        self.client = TestClient(create_app(self.engine, ServerConfig(prerender=False)))

    def sync(self) -> None:
        """The worker thread runs in order: a later preparation done, so is every claim
        queued before it; then the SSD writer and the cache's feeder are drained."""
        r = self.client.post("/v1/messages/count_tokens", json={
            "model": "default", "messages": [{"role": "user", "content": "sync"}]})
        assert r.status_code == 200
        assert self.cache.flush(timeout=30)

    def chat(self, key: str, system: str, user: str, retention: str | None) -> None:
        body: dict[str, Any] = {"model": "default", "max_tokens": 2, "prompt_cache_key": key,
                                "messages": [{"role": "system", "content": system},
                                             {"role": "user", "content": user}]}
        if retention is not None:
            body["prompt_cache_retention"] = retention
        r = self.client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        self.sync()

    def key_chain(self, key: str) -> tuple[BlockHash, ...]:
        [chain] = [v[0] for k, v in self.cache.levels.protections().items()
                   if k[0] == "key" and k[3] == key]
        return chain

    def pins(self, chain: tuple[BlockHash, ...]) -> list[float | None]:
        out = []
        for h in chain:
            row = self.ssd.catalog.index.get(bytes(h))
            assert row is not None, h.hex()  # on the SSD (write-through)
            out.append(row.pinned_until)
        return out

    def close(self) -> None:
        self.engine.close()


@pytest.fixture
def served(tiny_llama_path: Path, tmp_path: Path) -> Iterator[Served]:
    s = Served(tiny_llama_path, tmp_path)
    yield s
    s.close()


def test_24h_pins_the_chain_on_the_ssd_and_in_memory_does_not(served: Served) -> None:
    t0 = served.clock.t
    served.chat("k24", SYSTEM, "first task", "24h")
    pinned = served.key_chain("k24")
    assert len(pinned) >= 4
    assert served.pins(pinned) == [t0 + DAY] * len(pinned)
    served.clock.advance(100.0)
    served.chat("kmem", OTHER, "Bonjour to everyone", "in_memory")
    plain = served.key_chain("kmem")
    assert not set(plain) & set(pinned)
    assert served.pins(plain) == [None] * len(plain)
    # a later in_memory turn of the pinned conversation does not shorten its pin
    served.clock.advance(100.0)
    served.chat("k24", SYSTEM, "first task", "in_memory")
    assert served.pins(pinned) == [t0 + DAY] * len(pinned)
    s = served.ssd.stats()
    assert s["pinned_blocks"] == len(pinned)
    # an SSD eviction storm (the budget shrunk to exactly the pinned chain's bytes)
    # takes every unpinned block (the oldest of them were written before the pinned
    # chain's later turns), never a pinned one
    rows = list(served.ssd.catalog.index.iter_rows())
    unpinned = {BlockHash(bytes(r.meta.block_hash)) for r in rows} - set(pinned)
    assert set(plain) <= unpinned
    budget = sum(r.file_bytes for r in rows if r.meta.block_hash in set(pinned))
    served.ssd.config = dataclasses.replace(served.ssd.config, budget_bytes=budget)
    assert served.ssd.sweep() == len(unpinned)
    on_ssd = {BlockHash(bytes(r.meta.block_hash)) for r in served.ssd.catalog.index.iter_rows()}
    assert on_ssd == set(pinned)
    assert served.ssd.stats()["evictions_pinned"] == 0
    # a day after the request the pin is over: the storm takes them too
    served.clock.t = t0 + DAY
    served.ssd.config = dataclasses.replace(served.ssd.config, budget_bytes=1)
    served.ssd.sweep()
    assert served.ssd.stats()["blocks_on_disk"] == 0


def test_the_responses_api_pins_with_24h(served: Served) -> None:
    t0 = served.clock.t
    r = served.client.post("/v1/responses", json={
        "model": "default", "instructions": SYSTEM, "input": "list the files",
        "max_output_tokens": 2, "prompt_cache_key": "resp", "prompt_cache_retention": "24h"})
    assert r.status_code == 200, r.text
    served.sync()
    chain = served.key_chain("resp")
    assert chain and served.pins(chain) == [t0 + DAY] * len(chain)
