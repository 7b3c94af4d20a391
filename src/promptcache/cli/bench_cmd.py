"""`promptcache bench`: a launcher for the benchmark harness in a source checkout's
``bench/harness/`` (``$PROMPTCACHE_BENCH_DIR``, else the ``bench/`` beside ``src/``),
imported only when the command runs; without it, one line says a checkout is needed."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path
from typing import Protocol, cast

BENCH_DIR_ENV = "PROMPTCACHE_BENCH_DIR"
MISSING = ("promptcache bench needs a source checkout: no bench/harness/ found (set "
           f"{BENCH_DIR_ENV} to a checkout's bench/ folder)")


class _Command(Protocol):
    def register(self, sub: argparse._SubParsersAction) -> None: ...  # type: ignore[type-arg]


def bench_dir() -> Path | None:
    """The folder holding ``harness/``, or None when there is none."""
    env = os.environ.get(BENCH_DIR_ENV)
    folder = Path(env) if env else Path(__file__).resolve().parents[3] / "bench"
    return folder if (folder / "harness" / "__init__.py").is_file() else None


HELP = "benchmark S1..S5, E1 against mlx_lm.server / vllm-mlx (a source checkout)"


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`bench` hands its arguments as they are to the harness's parser (``--help`` too)."""
    p = sub.add_parser("bench", help=HELP, prefix_chars="+", add_help=False)
    p.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    p.set_defaults(func=_run)


def full_parser() -> argparse.ArgumentParser | str:
    """``promptcache`` with the harness's `bench` registered, or the line saying why not."""
    folder = bench_dir()
    if folder is None:
        return MISSING
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    try:
        command = cast(_Command, importlib.import_module("harness.command"))
    except ImportError as e:  # a broken harness must not take `serve` down with it
        return (f"promptcache bench: cannot import the harness in {folder} "
                f"({type(e).__name__}: {e})")
    parser = argparse.ArgumentParser(prog="promptcache")
    command.register(parser.add_subparsers(dest="command", required=True))
    return parser


def bench_parser() -> argparse.ArgumentParser | None:
    """The harness's `bench` parser (for docs/cli.md), None without a harness."""
    parser = full_parser()
    if isinstance(parser, str):
        return None
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return cast(argparse.ArgumentParser, action.choices["bench"])
    return None  # pragma: no cover - register always adds it


def _run(args: argparse.Namespace) -> int:
    parser = full_parser()
    if isinstance(parser, str):
        return _say(parser)
    full = parser.parse_args(["bench", *args.rest])
    return int(full.func(full) or 0)


def _say(line: str) -> int:
    print(line, file=sys.stderr)
    return 2
