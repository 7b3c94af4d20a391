"""docs/cli.md's reference section, generated from the parser at a fixed width:
``python -m promptcache.cli.reference docs/cli.md`` rewrites it (a test checks it)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from pathlib import Path

START = "<!-- cli:start (generated: python -m promptcache.cli.reference docs/cli.md) -->"
END = "<!-- cli:end -->"
WIDTH = "100"


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...]
             ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    if path == ("promptcache", "bench"):  # the harness's own parser (bench_cmd)
        from .bench_cmd import bench_parser

        parser = bench_parser() or parser
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def reference() -> str:
    """The generated section: one heading and help block per command."""
    from . import build_parser

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        out = []
        for path, parser in _parsers(build_parser(), ("promptcache",)):
            out += [f"### `{' '.join(path)}`", "", "```", parser.format_help().rstrip(), "```", ""]
        return "\n".join(out)
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


def section(text: str) -> str:
    """What a document holds between the markers."""
    start = text.index(START) + len(START)
    return text[start:text.index(END, start)].strip("\n") + "\n"


def rewrite(doc: Path) -> None:
    text = doc.read_text()
    start = text.index(START) + len(START)
    end = text.index(END, start)
    doc.write_text(text[:start] + "\n\n" + reference() + "\n" + text[end:])


if __name__ == "__main__":
    rewrite(Path(sys.argv[1]))
