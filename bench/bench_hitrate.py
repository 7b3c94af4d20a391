"""Hit rate on the agentic traces (tests/fixtures/traces): the share of each previous
turn's prompt + output that the next turn reused, for one server build.

Each trace is replayed as its client would (tests/server/trace_replay.py) against a real
``promptcache serve`` subprocess of the given source tree (``--src``: this checkout by
default; point it at an export of another commit for a "before" column) on the trace's
tiny model, RAM tier only. The reuse denominators are rendered by an in-process probe of
this checkout with the same canonicalization (``--no-canonicalize``), so both columns
count the same thing.

    python bench/bench_hitrate.py --label after
    python bench/bench_hitrate.py --label no-prerender --server-arg=--no-prerender
    git archive <commit> src | tar -x -C /tmp/before
    python bench/bench_hitrate.py --label before --src /tmp/before/src --no-canonicalize all

Results: a table on stdout and ``bench/out-hitrate/<label>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "server"))
sys.path.insert(0, str(ROOT / "tests"))  # models: the tiny test models

import trace_replay as R  # noqa: E402
from real_engine import tiny_engine  # noqa: E402

from harness.systems import free_port  # noqa: E402
from promptcache.serving_config import ServerConfig  # noqa: E402


def serve(src: Path, model: Path, port: int, args: argparse.Namespace, budget_mb: int | None,
          log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-c", "import sys; from promptcache.cli import main; sys.exit(main())",
           "serve", "--model", str(model), "--port", str(port), "--no-ssd",
           "--block-size", str(args.block_size), "--log-level", "warning",
           "--ram-budget", f"{budget_mb or args.ram_mb}MB"]
    cmd += args.server_arg
    env = {**os.environ, "PYTHONPATH": str(src)}
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("server did not start")
        time.sleep(0.2)


def run_trace(name: str, args: argparse.Namespace) -> R.TraceReport:
    from fastapi.testclient import TestClient

    from promptcache.server import create_app

    trace = R.load_trace(name)
    if args.trim:
        trace = R.trim(trace, args.trim)
    model = R.model_path(trace["model"], ROOT / ".models")
    renderer_engine = tiny_engine(model, None, block_size=args.block_size,
                                  chunk=args.block_size * 4)
    renderer = TestClient(create_app(renderer_engine, ServerConfig(
        canonicalize_off=tuple(args.no_canonicalize), prerender=False)))
    port = free_port()
    out = ROOT / "bench" / "out-hitrate"
    out.mkdir(parents=True, exist_ok=True)
    proc = serve(Path(args.src), model, port, args, trace.get("ram_budget_mb"),
                 out / f"{args.label}-{name}.log")
    base = f"http://127.0.0.1:{port}"
    client = httpx.Client(base_url=base, timeout=3600)

    def post(path: str, headers: dict[str, str], body: dict[str, Any]) -> tuple[int, str]:
        r = client.post(path, json=body, headers=headers)
        return r.status_code, r.text

    def probe(api: str, headers: dict[str, str], body: dict[str, Any]) -> list[int]:
        r = renderer.post(f"/v1/cache/probe?api={api}&tokens=true", json=body, headers=headers)
        if r.status_code != 200:
            raise RuntimeError(r.text)
        tokens: list[int] = r.json()["tokens"]
        return tokens

    def settle() -> None:
        """A client's think time: the server's background pre-renders finish."""
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            pre = client.get("/v1/cache/stats").json().get("prerender")
            if not pre or (pre["pending"] == 0 and pre["queued"] == 0):
                return
            time.sleep(0.05)

    try:
        return R.replay(trace, post, probe, settle)
    finally:
        client.close()
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        renderer_engine.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", required=True)
    p.add_argument("--src", default=str(ROOT / "src"), help="the source tree to serve")
    p.add_argument("--traces", nargs="*", default=None)
    p.add_argument("--trim", type=int, default=0, help="cut every trace string to N chars")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--ram-mb", type=int, default=2048)
    p.add_argument("--no-canonicalize", action="append", default=[], metavar="RULE",
                   help="canonicalization rules off in the renderer of the denominators "
                        "(match the served build: 'all' for a build without them)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="an extra argument of the served 'promptcache serve' (repeatable)")
    args = p.parse_args()
    results: dict[str, Any] = {"label": args.label, "src": args.src, "trim": args.trim,
                               "block_size": args.block_size, "traces": {}}
    for name in args.traces or R.trace_names():
        t0 = time.monotonic()
        report = run_trace(name, args)
        print(report.table(), f"({time.monotonic() - t0:.0f} s)", flush=True)
        results["traces"][name] = {
            "share": report.share, "min_share": report.min_share,
            "turns": [t.__dict__ for t in report.turns]}
    out = ROOT / "bench" / "out-hitrate" / f"{args.label}.json"
    out.write_text(json.dumps(results, indent=1))
    print("\n| trace | share | min turn |")
    print("| --- | --- | --- |")
    for name, r in results["traces"].items():
        print(f"| {name} | {r['share']:.1%} | {r['min_share']:.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
