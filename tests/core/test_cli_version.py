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


def test_top_level_help_is_for_users(capsys: pytest.CaptureFixture[str]) -> None:
    from promptcache.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    assert "prompt cache keeps every\nconversation's prefix" in out
    assert "promptcache serve                      serve the embedded default model" in out
    assert "register(subparsers)" not in out and "``" not in out
