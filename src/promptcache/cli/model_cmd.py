"""`promptcache model` (not built yet)."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("model", help="model (not built yet)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print("promptcache model: not built yet", file=sys.stderr)
    return 0
