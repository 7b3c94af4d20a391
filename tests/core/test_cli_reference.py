"""docs/cli.md's reference section is the one generated from the argument parser
(regenerate with ``python -m promptcache.cli.reference docs/cli.md``)."""

from __future__ import annotations

from pathlib import Path

from promptcache.cli.reference import reference, section

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def test_the_cli_reference_is_current() -> None:
    assert section(DOC.read_text()) == reference().strip("\n") + "\n"


def test_every_command_is_in_it() -> None:
    text = reference()
    for command in ("serve", "model prepare", "model info", "cache stats", "cache ls",
                    "cache check", "cache purge", "cache export", "cache import",
                    "cache sessions", "bench"):
        assert f"### `promptcache {command}`" in text, command
    assert "--kv-budget" in text and "--speculation" in text
