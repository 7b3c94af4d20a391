"""`promptcache cache stats | ls | check [--fix] | purge` on an SSD folder: read-only
without ``--fix``; ``check --fix`` and ``purge`` (asks first, or ``--yes``) take the
folder's exclusive lock."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..config import SSDConfig, parse_duration
from ..tiers.ssd import SSDTier
from .progress import progress_bar

__all__ = ["parse_duration", "register", "run"]


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("cache", help="inspect and maintain the SSD cache")
    csub = p.add_subparsers(dest="cache_command", required=True)

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        sp: argparse.ArgumentParser = csub.add_parser(name, help=help_)
        sp.add_argument(
            "--cache-dir",
            type=Path,
            default=SSDConfig().path,
            help="the SSD tier folder (default: %(default)s)",
        )
        sp.set_defaults(func=run)
        return sp

    add("stats", "counts and bytes per tenant")
    ls = add("ls", "list stored blocks, most recently used first")
    ls.add_argument("--tenant", default=None)
    ls.add_argument("--limit", type=int, default=50, help="at most this many rows (0: all)")
    chk = add("check", "compare the index with the files")
    chk.add_argument("--fix", action="store_true", help="repair what is found")
    from . import pack_cmd, sessions_cmd

    pack_cmd.register(csub, add)
    sessions_cmd.register(csub, add)
    pg = add("purge", "delete blocks")
    pg.add_argument("--tenant", default=None, help="only this tenant")
    pg.add_argument("--older-than", default=None, help="only blocks unused for D (7d, 12h, 30m)")
    ask = pg.add_mutually_exclusive_group()
    ask.add_argument("--yes", action="store_true",
                     help="delete without asking (needed when stdin is not a terminal)")
    ask.add_argument("--dry-run", action="store_true",
                     help="print how many blocks and bytes would be deleted; delete nothing")


def _open(args: argparse.Namespace, *, read_only: bool) -> SSDTier:
    cache_dir: Path = args.cache_dir
    if not cache_dir.is_dir():
        raise ValueError(f"cache folder {cache_dir} does not exist")
    return SSDTier(SSDConfig(path=cache_dir), reconcile_on_open=False, read_only=read_only)


def _purge(args: argparse.Namespace) -> int:
    """``cache purge``: count what matches (read-only), then ``--dry-run`` stops, a
    terminal is asked y/N, anything else needs ``--yes``; deletion under the lock."""
    older = parse_duration(args.older_than) if args.older_than is not None else None
    if args.dry_run or not args.yes:
        tier = _open(args, read_only=True)
        try:
            cutoff = time.time() - older if older is not None else None
            rows = [r for r in tier.rows(args.tenant)
                    if cutoff is None or r.last_access < cutoff]
        finally:
            tier.close()
        what = f"{len(rows)} block(s) ({sum(r.file_bytes for r in rows)} bytes)"
        if args.dry_run:
            print(f"would purge {what}; nothing deleted (--dry-run)")
            return 0
        if not sys.stdin.isatty():
            raise ValueError(f"cache purge would delete {what} from {args.cache_dir} and "
                             "stdin is not a terminal to confirm: pass --yes (or --dry-run)")
        print(f"delete {what} from {args.cache_dir}? [y/N] ", end="", file=sys.stderr,
              flush=True)
        if sys.stdin.readline().strip().lower() not in ("y", "yes"):
            print("promptcache cache purge: nothing deleted", file=sys.stderr)
            return 1
    tier = _open(args, read_only=False)
    try:
        n = tier.purge(tenant=args.tenant, older_than_s=older)
    finally:
        tier.close()
    print(f"purged {n} block(s)")
    return 0


def run(args: argparse.Namespace) -> int:
    cmd = args.cache_command
    if cmd == "purge":
        return _purge(args)
    if cmd == "ls" and args.limit < 0:
        raise ValueError(f"--limit must be >= 0, got {args.limit}")
    changes = cmd == "check" and args.fix
    tier = _open(args, read_only=not changes)
    try:
        if cmd == "stats":
            s = tier.stats()
            out = {
                "cache_dir": str(args.cache_dir),
                "blocks": s["blocks_on_disk"],
                "bytes": s["bytes_on_disk"],
                "bytes_written": s["bytes_written"],
                "degraded": s["degraded"],
                "mode": s["mode"],
                "tenants": {t: {"blocks": n, "bytes": b} for t, n, b in tier.tenants()},
            }
            print(json.dumps(out, indent=2))
            return 0
        if cmd == "ls":
            rows = tier.rows(args.tenant)
            if args.limit:
                rows = rows[: args.limit]
            print(f"{'hash':16}  {'tenant':12} {'start':>7} {'tokens':>6} {'bytes':>10} {'hits':>5}  last access")
            for r in rows:
                when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.last_access))
                print(
                    f"{r.meta.block_hash.hex()[:16]}  {r.meta.tenant:12} {r.meta.start:>7} "
                    f"{r.meta.num_tokens:>6} {r.file_bytes:>10} {r.hits:>5}  {when}"
                )
            return 0
        if cmd == "check":
            with progress_bar("checking the cache folder") as bar:
                report = tier.check(fix=args.fix, progress=bar)
            print(json.dumps(report.to_dict(), indent=2))
            if report.refused is not None:
                print(f"promptcache cache check: {report.refused}", file=sys.stderr)
                return 2
            if report.problems and not args.fix:
                print(
                    f"promptcache cache check: {report.problems} problem(s); run with --fix",
                    file=sys.stderr,
                )
                return 1
            return 0
        raise ValueError(f"unknown cache command {cmd!r}")
    finally:
        tier.close()
