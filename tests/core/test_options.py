"""options.py: flags declared on a config dataclass's fields, its __post_init__ the check."""

from __future__ import annotations

import argparse
import operator
from dataclasses import dataclass

import pytest

from promptcache.config import parse_size
from promptcache.options import add_options, from_args, opt


@dataclass(frozen=True)
class Toy:
    max_items: int = opt("--max-items", "--items", default=4, help="items (default %(default)s)")
    size_bytes: int = opt("--size", default=1024, flag_default="1KB", parse=parse_size)
    enabled: bool = opt("--no-toy", default=True, switch=True, parse=operator.not_)
    mode: str = opt("--mode", default="a", choices=("a", "b"))
    hidden: int = 7

    def __post_init__(self) -> None:
        if self.max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {self.max_items}")


def _toy(*argv: str, **given: object) -> Toy:
    parser = argparse.ArgumentParser()
    add_options(parser, Toy)
    return from_args(Toy, parser.parse_args(list(argv)), **given)


def test_flags_defaults_aliases_and_parsers() -> None:
    assert _toy() == Toy(max_items=4, size_bytes=1024, enabled=True, mode="a", hidden=7)
    assert _toy("--items", "2", "--size", "2KB", "--no-toy", "--mode", "b") == Toy(
        max_items=2, size_bytes=2048, enabled=False, mode="b")
    assert _toy(hidden=1, max_items=9).hidden == 1 and _toy(max_items=9).max_items == 9
    parser = argparse.ArgumentParser()
    add_options(parser, Toy)
    assert "items (default 4)" in " ".join(parser.format_help().split())
    with pytest.raises(SystemExit):
        parser.parse_args(["--mode", "c"])


def test_errors_are_in_the_flags_words() -> None:
    with pytest.raises(ValueError, match=r"^--max-items must be >= 1, got 0$"):
        _toy("--max-items", "0")
    with pytest.raises(ValueError, match=r"^--size: invalid size: 'lots'"):
        _toy("--size", "lots")
