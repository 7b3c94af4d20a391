"""`promptcache bench` (not built yet)."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("bench", help="bench (not built yet)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print("promptcache bench: not built yet", file=sys.stderr)
    return 0
