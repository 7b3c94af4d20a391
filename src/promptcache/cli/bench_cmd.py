"""`promptcache bench`: a launcher for the benchmark harness, which lives in a source
checkout's ``bench/harness/`` (not in the installed package).

The folder is ``$PROMPTCACHE_BENCH_DIR`` when set, else the ``bench/`` beside this
package's ``src/`` (an editable install). The harness registers the command's options
itself; without it, `promptcache bench` says in one line that it needs a checkout.
"""

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


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    folder = bench_dir()
    if folder is None:
        _stub(sub, MISSING)
        return
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    try:
        command = cast(_Command, importlib.import_module("harness.command"))
    except ImportError as e:  # a broken harness must not take `serve` down with it
        _stub(sub, f"promptcache bench: cannot import the harness in {folder} "
                   f"({type(e).__name__}: {e})")
        return
    command.register(sub)


def _stub(sub: argparse._SubParsersAction, line: str) -> None:  # type: ignore[type-arg]
    """`bench` that answers ``line`` on stderr, exit 2, whatever it is given (-h too)."""
    p = sub.add_parser("bench", help="benchmarks (needs a source checkout)", description=line,
                       prefix_chars="+", add_help=False)
    p.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    p.set_defaults(func=lambda _args: _say(line))


def _say(line: str) -> int:
    print(line, file=sys.stderr)
    return 2
