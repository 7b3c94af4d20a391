"""`promptcache cache sessions`: list sessions (sizes, last use) and ``--delete`` one, on an
SSD folder (its index) or, with ``--server URL``, on a running server (its RAM and every
tier). Without ``--tenant`` a deletion acts in every tenant."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from ..config import SSDConfig
from ..meta import validate_tenant


def register(csub: Any, add: Callable[[str, str], argparse.ArgumentParser]) -> None:
    sp = add("sessions", "list sessions with sizes and last use; delete one")
    sp.add_argument("--tenant", default=None, help="only this tenant")
    sp.add_argument("--delete", metavar="SESSION", default=None, help="delete this session")
    sp.add_argument("--server", default=None, help="a running server's base URL instead of "
                                                  "the folder (reaches its RAM too)")
    sp.add_argument("--api-key", default=None, help="the server's API key")
    sp.add_argument("--json", action="store_true", help="print JSON")
    sp.set_defaults(func=run)


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _server(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    params = {"tenant": args.tenant} if args.tenant else {}
    base = args.server.rstrip("/")
    try:
        if args.delete:
            r = httpx.delete(f"{base}/v1/cache/sessions/{args.delete}", params=params,
                             headers=headers, timeout=120)
        else:
            r = httpx.get(f"{base}/v1/cache/sessions", params=params, headers=headers,
                          timeout=120)
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach {base}: {e}") from e
    if r.status_code != 200:
        raise ValueError(f"{base} answered {r.status_code}: {r.text[:300]}")
    data: dict[str, Any] = r.json()
    return data


def _folder(args: argparse.Namespace) -> dict[str, Any]:
    from ..tiers.ssd import SSDTier

    if not args.cache_dir.is_dir():
        raise ValueError(f"cache folder {args.cache_dir} does not exist")
    tier = SSDTier(SSDConfig(path=args.cache_dir), reconcile_on_open=False,
                   read_only=not args.delete)
    try:
        if args.delete:
            n = tier.delete_session(args.delete, args.tenant)
            return {"deleted_blocks": int(n), "session_id": args.delete, "tenant": args.tenant}
        return {"tenant": args.tenant, "sessions": [
            {"tenant": t, "session_id": s, "blocks": n, "last_use": last,
             "tiers": {"ssd": {"blocks": n, "bytes": nbytes, "last_use": last}}}
            for t, s, n, nbytes, last in tier.sessions(args.tenant)]}
    finally:
        tier.close()


def run(args: argparse.Namespace) -> int:
    if args.tenant is not None:
        validate_tenant(args.tenant)
    data = _server(args) if args.server else _folder(args)
    if args.json or args.delete:
        print(json.dumps(data, indent=2))
        return 0
    rows = data.get("sessions", [])
    print(f"{'tenant':12} {'session':36} {'blocks':>7} {'ram bytes':>12} {'ssd bytes':>12}  last use")
    for r in rows:
        tiers = r["tiers"]
        print(f"{r['tenant']:12} {r['session_id'][:36]:36} {r.get('blocks', 0):>7} "
              f"{tiers.get('ram', {}).get('bytes', 0):>12} {tiers.get('ssd', {}).get('bytes', 0):>12}"
              f"  {_when(r.get('last_use'))}")
    print(f"{len(rows)} session(s)")
    return 0
