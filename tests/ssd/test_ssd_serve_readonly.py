"""A read-only or not-ours cache folder: ``serve`` starts (issue 23) and serves the
blocks already in it (issue 42): the tier is ``read_only`` (degraded), says why in
``/v1/cache/stats`` and in ``/health``, lookups and restores hit its blocks, writes
are skipped and counted, and no file of the folder is touched. A folder that cannot
be created is ``off``.

The read-only file system is injected at the tier's seam (``ssd_files.probe_writable``
raising EROFS / EACCES): the tests run as root, where chmod stops nothing. One test
uses a real immutable folder (``chattr +i``) where the file system allows it.
"""

from __future__ import annotations

import errno
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from fastapi.testclient import TestClient
from ssd_helpers import NS, chain, make_tier, payload_for

from promptcache.cli import build_parser, serve_cmd
from promptcache.cli.wiring import build_cache
from promptcache.config import GB, CacheConfig, SSDConfig
from promptcache.server import create_app
from promptcache.serving_config import ServerConfig
from promptcache.tiers import ssd_files, ssd_index

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
from fake_engine import FakeEngine  # noqa: E402


def populate(root: Path, n: int = 3) -> dict[str, bytes]:
    tier = make_tier(root)
    for i, m in enumerate(chain(NS, n)):
        tier.put(m, payload_for(i))
    tier.close()
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*.safetensors")}


def read_only_fs(monkeypatch: pytest.MonkeyPatch, err: int = errno.EROFS) -> None:
    def refuse(root: Path) -> None:
        raise OSError(err, "Read-only file system" if err == errno.EROFS
                      else "Permission denied", str(root))

    monkeypatch.setattr(ssd_files, "probe_writable", refuse)


def served(root: Path) -> TestClient:
    cache = build_cache(CacheConfig(block_size=4, ram_budget_bytes=1 << 20),
                        SSDConfig(path=root, fsync=False))
    engine = FakeEngine()
    engine.cache = cache  # type: ignore[assignment]
    return TestClient(create_app(engine, ServerConfig()))


@pytest.mark.parametrize("err, text", [(errno.EROFS, "Read-only file system"),
                                       (errno.EACCES, "Permission denied")])
def test_unwritable_folder_serves_its_blocks_read_only(tmp_path, monkeypatch, err, text):
    before = populate(tmp_path)
    read_only_fs(monkeypatch, err)
    client = served(tmp_path)

    health = client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    ssd = health.json()["tiers"]["ssd"]
    assert (ssd["mode"], ssd["degraded"]) == ("read_only", True)
    assert "reason" not in ssd  # no paths in /health without a key

    stats = client.get("/v1/cache/stats").json()["cache"]["tiers"]["ssd"]
    assert (stats["mode"], stats["degraded"], stats["blocks_on_disk"]) == ("read_only", True, 3)
    assert stats["mode_reason"] == (
        f"cache folder {tmp_path} is not writable: [Errno {err}] {text}: '{tmp_path}': its "
        "blocks are served read-only (no writes, no repairs)")
    # a normal request beside it answers
    r = client.post("/v1/messages/count_tokens", json={
        "model": "default", "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200 and r.json()["input_tokens"] > 0
    client.close()
    after = {str(p.relative_to(tmp_path)): p.read_bytes() for p in tmp_path.rglob("*.safetensors")}
    assert after == before


def test_read_only_tier_reads_its_blocks_and_counts_refused_writes(tmp_path, monkeypatch):
    populate(tmp_path)
    names = sorted(p.name for p in tmp_path.rglob("*"))
    # (SQLite's -wal / -shm beside the index: created by mode=ro only where it can write,
    # as root here; a really read-only folder opens the index immutable, see below)
    sidecars = {"index.sqlite-wal", "index.sqlite-shm"}
    read_only_fs(monkeypatch)
    cache = build_cache(CacheConfig(block_size=4, ram_budget_bytes=1 << 20),
                        SSDConfig(path=tmp_path, fsync=False))
    assert cache is not None
    (tier,) = cache.lower
    assert tier.mode == "read_only"
    metas = chain(NS, 4)
    for i, m in enumerate(metas[:3]):  # the blocks written before: found and read
        got = tier.get_meta(m.block_hash)
        assert got is not None and got.token_ids == m.token_ids
        assert tier.get(m.block_hash) == payload_for(i)
    assert tier.get_meta(metas[3].block_hash) is None
    assert tier.put(metas[3], payload_for(3)) is False
    s = tier.stats()
    assert (s["dropped_spills"]["read_only"], s["dropped_spills_total"], s["spills"]) == (1, 1, 0)
    assert s["blocks_on_disk"] == 3
    cache.close()
    assert sorted(p.name for p in tmp_path.rglob("*") if p.name not in sidecars) == names


def test_read_only_folder_whose_index_sqlite_cannot_share_is_opened_immutable(
        tmp_path, monkeypatch):
    """A read-only folder without the index's ``-shm``: SQLite's ``mode=ro`` cannot open
    it (injected: root can always create the file), ``immutable=1`` can."""
    populate(tmp_path)
    read_only_fs(monkeypatch)
    real = sqlite3.connect
    uris: list[str] = []

    def connect(database: str, *a: Any, **kw: Any) -> sqlite3.Connection:
        uris.append(str(database))
        if "mode=ro" in str(database) and "immutable=1" not in str(database):
            raise sqlite3.OperationalError("unable to open database file")
        return real(database, *a, **kw)

    monkeypatch.setattr(ssd_index.sqlite3, "connect", connect)
    tier = make_tier(tmp_path)
    assert tier.mode == "read_only"
    assert [u.split("?")[1] for u in uris] == ["mode=ro", "mode=ro&immutable=1"]
    m = chain(NS, 3)[2]
    assert tier.get(m.block_hash) == payload_for(2)
    tier.close()


def test_read_only_folder_without_an_index_is_off(tmp_path, monkeypatch):
    read_only_fs(monkeypatch)
    tier = make_tier(tmp_path)
    assert tier.mode == "off"
    assert "not writable" in tier.stats()["mode_reason"]
    assert "cannot open the index" in tier.stats()["mode_reason"]
    assert tier.put(chain(NS, 1)[0], payload_for(0)) is False
    assert tier.stats()["dropped_spills"]["off"] == 1
    tier.close()
    assert list(tmp_path.iterdir()) == []


def test_health_without_lower_tiers_has_no_tiers_entry(tmp_path):
    client = TestClient(create_app(FakeEngine(), ServerConfig()))
    assert "tiers" not in client.get("/health").json()


class _Usage(NamedTuple):
    total: int
    used: int
    free: int


def test_serve_configs_survive_an_uncreatable_cache_dir(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"x")
    asked: list[Path] = []

    def usage(p: Path) -> _Usage:
        asked.append(Path(p))
        if not Path(p).exists():
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(p))
        if Path(p).is_file():
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", str(p))
        return _Usage(16 * GB, 8 * GB, 8 * GB)

    monkeypatch.setattr("shutil.disk_usage", usage)  # what serve_config reads
    args = build_parser().parse_args(["serve", "--cache-dir", str(blocker / "blocks"),
                                      "--ssd-budget", "50%"])
    _, _, ssd_cfg, _ = serve_cmd.build_configs(args)
    assert ssd_cfg is not None and ssd_cfg.path == blocker / "blocks"
    assert ssd_cfg.budget_bytes == 4 * GB  # 50% of the free space of the nearest folder
    assert asked[-1] == tmp_path
    tier = make_tier(ssd_cfg.path)
    assert tier.mode == "off" and "cannot create" in tier.stats()["mode_reason"]
    tier.close()


def _chattr(flag: str, path: Path) -> bool:
    if shutil.which("chattr") is None:
        return False
    return subprocess.run(["chattr", flag, str(path)], capture_output=True).returncode == 0


def test_really_immutable_folder_serves_its_blocks_read_only(tmp_path):
    root = tmp_path / "cache"
    before = populate(root)
    if not _chattr("+i", root):
        pytest.skip("chattr +i is not available here (needs CAP_LINUX_IMMUTABLE, ext4/xfs)")
    try:
        client = served(root)
        ssd = client.get("/health").json()["tiers"]["ssd"]
        assert (ssd["mode"], ssd["degraded"]) == ("read_only", True)
        stats = client.get("/v1/cache/stats").json()["cache"]["tiers"]["ssd"]
        assert stats["blocks_on_disk"] == 3
        client.close()
    finally:
        _chattr("-i", root)
    after = {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*.safetensors")}
    assert after == before


def test_a_real_engine_restores_from_a_read_only_folder(tmp_path, monkeypatch,
                                                       tiny_llama_path):
    """A first engine writes a conversation's blocks; a second one, over the same folder
    made unwritable, hits and restores them from the SSD tier (greedy: the same reply),
    its own blocks skipped and counted, and a new prompt beside it still answers."""
    from real_engine import tiny_engine  # tests/server (on the path above)

    cfg = CacheConfig(block_size=8, ram_budget_bytes=64 << 20)
    body = {"model": "default", "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me about caches, in detail."}]}

    def run(fresh: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any],
                                                         dict[str, Any] | None]:
        cache = build_cache(cfg, SSDConfig(path=tmp_path, fsync=False))
        assert cache is not None
        closed.append(cache.lower[0])
        engine = tiny_engine(tiny_llama_path, cache, block_size=8)
        try:
            client = TestClient(create_app(engine, ServerConfig(prerender=False)))
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            other = None
            if fresh is not None:
                o = client.post("/v1/chat/completions", json=fresh)
                assert o.status_code == 200, o.text
                other = o.json()
            ssd = client.get("/v1/cache/stats").json()["cache"]["tiers"]["ssd"]
            rendered.extend(engine.render_chat(b["messages"]) for b in (body, fresh or body))
            return r.json(), ssd, other
        finally:
            engine.close()

    closed: list[Any] = []  # each run's SSD tier (its counters after the close)
    rendered: list[list[int]] = []
    first, ssd1, _ = run()
    assert ssd1["mode"] == "read_write"
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    files_before = {str(p.relative_to(tmp_path)): p.read_bytes()
                    for p in tmp_path.rglob("*.safetensors")}
    assert files_before  # the first engine's blocks are on disk
    read_only_fs(monkeypatch)
    fresh = {**body, "messages": [{"role": "user", "content": "Something else entirely."}]}
    second, ssd2, other = run(fresh)
    prompt = first["usage"]["prompt_tokens"]
    assert second["usage"]["prompt_tokens"] == prompt
    # all of it but the last token (re-run for its logits; the last partial block is
    # stored too)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt - 1
    assert second["choices"][0]["message"] == first["choices"][0]["message"]
    assert (ssd2["mode"], ssd2["degraded"]) == ("read_only", True)
    assert ssd2["hits"] > 0
    # the blocks of both prompts, offered at the close (write-back: persist), refused
    after_close = closed[1].stats()
    assert after_close["spills"] == 0
    assert after_close["dropped_spills"]["read_only"] == after_close["dropped_spills_total"] > 0
    assert other is not None and other["usage"]["completion_tokens"] == 6
    # the other prompt hits only what it shares with the first (the template's head)
    a, b = rendered[-2:]
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert 0 < shared < 8
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == shared
    after = {str(p.relative_to(tmp_path)): p.read_bytes() for p in tmp_path.rglob("*.safetensors")}
    assert after == files_before
