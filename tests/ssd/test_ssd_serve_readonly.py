"""A read-only or not-ours cache folder: ``serve`` starts without the SSD tier
(issue 23): the tier is ``off``, says why in ``/v1/cache/stats`` and in
``/health``, and no file of the folder is touched.

The read-only file system is injected at the tier's seam (``ssd_files.probe_writable``
raising EROFS / EACCES): the tests run as root, where chmod stops nothing. One test
uses a real immutable folder (``chattr +i``) where the file system allows it.
"""

from __future__ import annotations

import errno
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
from fastapi.testclient import TestClient
from ssd_helpers import NS, chain, make_tier, payload_for

from promptcache.cli import build_parser, serve_cmd
from promptcache.cli.wiring import build_cache
from promptcache.config import GB, CacheConfig, SSDConfig
from promptcache.server import create_app
from promptcache.serving_config import ServerConfig
from promptcache.tiers import ssd_files

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
def test_unwritable_folder_serves_without_the_ssd_tier(tmp_path, monkeypatch, err, text):
    before = populate(tmp_path)
    read_only_fs(monkeypatch, err)
    client = served(tmp_path)

    health = client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    ssd = health.json()["tiers"]["ssd"]
    assert (ssd["mode"], ssd["degraded"]) == ("off", True)
    assert "not writable" in ssd["reason"] and text in ssd["reason"]

    stats = client.get("/v1/cache/stats").json()["cache"]["tiers"]["ssd"]
    assert (stats["mode"], stats["degraded"], stats["blocks_on_disk"]) == ("off", True, 0)
    assert text in stats["mode_reason"]
    after = {str(p.relative_to(tmp_path)): p.read_bytes() for p in tmp_path.rglob("*.safetensors")}
    assert after == before


def test_off_tier_refuses_writes_and_counts_them(tmp_path, monkeypatch):
    populate(tmp_path)
    read_only_fs(monkeypatch)
    cache = build_cache(CacheConfig(block_size=4, ram_budget_bytes=1 << 20),
                        SSDConfig(path=tmp_path, fsync=False))
    assert cache is not None
    (tier,) = cache.lower
    m = chain(NS, 4)[-1]
    assert tier.get_meta(m.block_hash) is None
    assert tier.put(m, payload_for(3)) is False
    s = tier.stats()
    assert (s["dropped_spills"]["off"], s["spills"]) == (1, 0)
    cache.close()


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

    monkeypatch.setattr(serve_cmd.shutil, "disk_usage", usage)
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


def test_really_immutable_folder_serves_without_the_ssd_tier(tmp_path):
    root = tmp_path / "cache"
    before = populate(root)
    if not _chattr("+i", root):
        pytest.skip("chattr +i is not available here (needs CAP_LINUX_IMMUTABLE, ext4/xfs)")
    try:
        client = served(root)
        ssd = client.get("/health").json()["tiers"]["ssd"]
        assert ssd["mode"] == "off" and "not writable" in ssd["reason"]
        client.close()
    finally:
        _chattr("-i", root)
    after = {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*.safetensors")}
    assert after == before
