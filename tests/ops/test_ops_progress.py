"""Progress bars: drawn (rich) on a terminal, silent otherwise; the long operations
report their progress through the ``(done, total)`` callback."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from promptcache import packfile, packs
from promptcache.cache import PromptCache
from promptcache.cli import progress
from promptcache.config import CacheConfig, SSDConfig
from promptcache.meta import Namespace
from promptcache.tiers.ssd import SSDTier


class TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_quiet_off_a_terminal_drawn_on_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PROMPTCACHE_PROGRESS", raising=False)
    pipe = io.StringIO()
    with progress.progress_bar("copying", stream=pipe) as bar:
        for i in range(1, 4):
            bar(i, 3)
    assert pipe.getvalue() == ""
    tty = TTY()
    with progress.progress_bar("copying", stream=tty) as bar:
        for i in range(1, 4):
            bar(i, 3)
    assert "copying" in tty.getvalue() and "3/3" in tty.getvalue()
    monkeypatch.setenv("PROMPTCACHE_PROGRESS", "0")
    tty = TTY()
    with progress.progress_bar("copying", stream=tty) as bar:
        bar(1, 1)
    assert tty.getvalue() == ""
    monkeypatch.setenv("PROMPTCACHE_PROGRESS", "1")
    assert progress.enabled(io.StringIO())


def test_long_operations_report_progress(tmp_path: Path) -> None:
    ns = Namespace("m", 4)
    tier = SSDTier(SSDConfig(path=tmp_path / "ssd", fsync=False))
    cache = PromptCache(CacheConfig(block_size=4, ram_budget_bytes=1 << 20), lower=[tier],
                        write_through=True)
    cache.store(ns, list(range(40)), 40,
                lambda s, e, snap: {"0.k": np.zeros((1, 1, e - s, 2), np.float32)})
    assert cache.flush(30)
    calls: list[tuple[int, int]] = []
    tier.check(progress=lambda d, t: calls.append((d, t)))
    assert calls[0] == (0, 10) and calls[-1] == (10, 10)
    seen: dict[str, list[tuple[int, int]]] = {"collect": [], "write": [], "read": [],
                                              "import": []}
    blocks = packs.collect(cache, ns, tokens=list(range(41)),
                           progress=lambda d, t: seen["collect"].append((d, t)))
    buf = io.BytesIO()
    packfile.write_pack(buf, ns, blocks, {}, progress=lambda d, t: seen["write"].append((d, t)))
    pack = packfile.read_pack(buf.getvalue(), progress=lambda d, t: seen["read"].append((d, t)))
    cache.delete()
    packs.import_into(cache, pack, ns, progress=lambda d, t: seen["import"].append((d, t)))
    for what, got in seen.items():
        assert got[-1] == (10, 10), what
        assert [d for d, _ in got] == sorted(d for d, _ in got), what
    cache.close(persist=False)
