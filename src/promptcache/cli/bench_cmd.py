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
        # every argument, options and -h included, lands in `rest`: the one line answers
        p = sub.add_parser("bench", help="benchmarks (needs a source checkout)",
                           description=MISSING, prefix_chars="+", add_help=False)
        p.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
        p.set_defaults(func=_missing)
        return
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    cast(_Command, importlib.import_module("harness.command")).register(sub)


def _missing(_args: argparse.Namespace) -> int:
    print(MISSING, file=sys.stderr)
    return 2
