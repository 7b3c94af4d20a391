"""The import rules of ``[tool.importlinter]`` (pyproject.toml), run by ``make lint``:
they hold on the tree, and they catch a deliberate violation (on a copy of the tree
whose engine imports the server, whose cache imports mlx, whose server imports
blocks/ and whose decode batch imports a module inside engine/speculation/)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).parent / "lint-imports"

pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed")


def _lint(src: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run([str(LINT), "--config", str(ROOT / "pyproject.toml"),
                           "--no-cache"], cwd=src.parent, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_tree_keeps_every_import_rule() -> None:
    done = _lint(ROOT / "src")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def test_a_deliberate_violation_is_caught(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "promptcache", src / "promptcache",
                    ignore=shutil.ignore_patterns("__pycache__", "static"))
    with (src / "promptcache" / "engine" / "__init__.py").open("a") as f:
        f.write("\nimport promptcache.server.api.errors  # noqa\n")
    with (src / "promptcache" / "cache" / "ops.py").open("a") as f:
        f.write("\nimport mlx.core  # noqa\n")
    with (src / "promptcache" / "server" / "app.py").open("a") as f:
        f.write("\nimport promptcache.blocks.tokens  # noqa\n")
    with (src / "promptcache" / "engine" / "requests" / "batch.py").open("a") as f:
        f.write("\nimport promptcache.engine.speculation.drafts  # noqa\n")
    done = _lint(src)
    assert done.returncode != 0
    # broken: the layers, the engine's own rule, mlx outside engine/, the server's door,
    # speculation's door
    assert "Contracts: 4 kept, 5 broken." in done.stdout, done.stdout
    assert "promptcache.engine.requests.batch -> promptcache.engine.speculation.drafts" in done.stdout
    assert "promptcache.server.app -> promptcache.blocks.tokens" in done.stdout
    assert "promptcache.engine -> promptcache.server.api.errors" in done.stdout
    assert "promptcache.cache.ops -> mlx" in done.stdout
