"""A real `promptcache serve` (tiny llama, block size 4) and its SSD folder:

* a clean shutdown (SIGTERM) with 1000 blocks in RAM writes all 1000 under both
  policies, and the restarted server hits the whole prompt;
* a write-through burst (a 4,000-token prompt = 1000 blocks) through an SSD queue of 4
  reaches the SSD completely while the server runs, so a kill -9 right after loses
  nothing: the restarted server hits the whole prompt.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from server_proc import Server, token_prompt

from promptcache.config import SSDConfig
from promptcache.tiers.ssd import SSDTier

BS = 4
PROMPT = token_prompt(4000)  # 1000 blocks


def on_disk(folder: Path) -> tuple[int, int]:
    """(blocks, problems) of the folder as a fresh process sees it (no repair)."""
    tier = SSDTier(SSDConfig(path=folder), reconcile_on_open=False)
    try:
        return tier.stats()["blocks_on_disk"], tier.check(fix=False).problems
    finally:
        tier.close()


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_clean_shutdown_with_1000_ram_blocks_keeps_all_of_them(tiny_llama_path, tmp_path, policy):
    folder = tmp_path / "blocks"
    args = ("--block-size", str(BS), "--ssd-policy", policy)
    with Server(tiny_llama_path, folder, tmp_path / "first.log", *args) as s:
        first = s.complete(PROMPT, max_tokens=1)
        st = s.stats()["cache"]
        assert (st["ram_blocks"], st["drops"]) == (1000, 0)
        assert s.stop() == 0
    log = s.log()
    assert "persist:" not in log  # no "did not reach" warning
    if policy == "write_back":
        assert "persisted 1000 RAM blocks" in log
    assert on_disk(folder) == (1000, 0)
    with Server(tiny_llama_path, folder, tmp_path / "second.log", *args) as s:
        again = s.complete(PROMPT, max_tokens=1)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PROMPT) - 1
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert s.stop() == 0


def test_write_through_burst_through_a_queue_of_4_survives_kill_9(tiny_llama_path, tmp_path):
    folder = tmp_path / "blocks"
    args = ("--block-size", str(BS), "--ssd-policy", "write_through", "--ssd-queue-size", "4")
    with Server(tiny_llama_path, folder, tmp_path / "first.log", *args) as s:
        first = s.complete(PROMPT, max_tokens=1)
        st = s.wait_written()  # "a flush": nothing waits for the SSD any more
        ssd = st["tiers"]["ssd"]
        assert (ssd["blocks_on_disk"], ssd["dropped_spills_total"]) == (1000, 0)
        assert st["write_through_deferred"] > 0  # the queue of 4 really overflowed
        assert st["write_through"] == 1000 and st["demotion_failures"] == 0
        s.kill()  # kill -9: no shutdown, no persist
    blocks, problems = on_disk(folder)
    assert blocks == 1000 and problems == 0
    with Server(tiny_llama_path, folder, tmp_path / "second.log", *args) as s:
        again = s.complete(PROMPT, max_tokens=1)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PROMPT) - 1
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert s.stop() == 0
