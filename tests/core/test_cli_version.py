"""`promptcache --version` prints the package's version (the one pyproject.toml declares)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

import promptcache
from promptcache.cli import main

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    declared = tomllib.loads(PYPROJECT.read_text())["project"]["version"]
    assert promptcache.__version__ == declared
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"promptcache {declared}\n"
