"""The README's promise walked as a new user: ``make serve`` (the embedded default
model, the default port), then Claude Code, Codex and OpenCode configured from the
docs/clients blocks unchanged, two turns each; the second turn's prompt read from the
cache. Slow on a 2-core CPU (a cold 20K-token prefill of the default model); it prints
how long each turn took and how much of it came from the cache.

    python bench/walkthrough_clients.py [--serve-cmd "make serve"] [--out FILE]

The automation adds only what running a CLI unattended needs (a fresh HOME, no
telemetry or updates; Claude Code: ``API_TIMEOUT_MS`` for a prefill longer than its
10-minute default and ``CLAUDE_CODE_MAX_OUTPUT_TOKENS`` so a small model's reply ends).
Needs the pinned CLIs (``.ci/run`` installs them under ~/.cache/promptcache/clients).
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "clients"), str(REPO / "tests")]

from clients_helpers import (  # noqa: E402
    DOC_BASE,
    claude_env,
    cli_path,
    codex_env,
    json_lines,
    opencode_env,
)

TURN_TIMEOUT_S = 3600


def _healthy(base: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit("the server did not become healthy")


def _run(argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, str, int]:
    import os

    full = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
            "TERM": "dumb", "NO_COLOR": "1", **env}
    t = time.monotonic()
    p = subprocess.run(argv, cwd=cwd, env=full, stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=TURN_TIMEOUT_S, check=False)
    return time.monotonic() - t, p.stdout + "\n" + p.stderr[-3000:], p.returncode


def _stats(base: str) -> dict[str, Any]:
    with urllib.request.urlopen(base + "/v1/cache/stats", timeout=10) as r:
        return dict(json.loads(r.read())["cache"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve-cmd", default="make serve")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--clients", default="claude,codex,opencode")
    args = ap.parse_args()
    base = DOC_BASE
    tmp = Path(tempfile.mkdtemp(prefix="walkthrough-"))
    log = open(tmp / "server.log", "wb")
    t0 = time.monotonic()
    proc = subprocess.Popen(shlex.split(args.serve_cmd), cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    rows: list[str] = []
    try:
        _healthy(base, proc, 1800)
        rows.append(f"- `{args.serve_cmd}` healthy after {time.monotonic() - t0:.0f} s")
        for name in args.clients.split(","):
            exe = cli_path(name)
            if exe is None:
                rows.append(f"- {name}: not installed")
                continue
            work, home = tmp / name / "project", tmp / name / "home"
            work.mkdir(parents=True)
            if name == "claude":
                env = {**claude_env(home, base), "API_TIMEOUT_MS": str(TURN_TIMEOUT_S * 1000),
                       "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "1024"}
                turns = [[str(exe), "-p", "say hi", "--output-format", "json"],
                         [str(exe), "-p", "--continue", "and now?", "--output-format", "json"]]
            elif name == "codex":
                env = codex_env(home, base)
                argv = [str(exe), "exec", "--json", "--skip-git-repo-check"]
                turns = [argv + ["say hi"], argv + ["resume", "--last", "and now?"]]
            else:
                env = opencode_env(home, work, base, 32768)
                turns = [[str(exe), "run", "--format", "json", "say hi"],
                         [str(exe), "run", "--continue", "--format", "json", "and now?"]]
            for i, argv in enumerate(turns, 1):
                before = _stats(base)
                took, out, rc = _run(argv, work, env)
                after = _stats(base)
                hit = after.get("hit_tokens", 0) - before.get("hit_tokens", 0)
                miss = after.get("miss_tokens", 0) - before.get("miss_tokens", 0)
                share = hit / (hit + miss) if hit + miss else 0.0
                reply = ""
                for e in json_lines(out):
                    reply = str(e.get("result") or e.get("item", {}).get("text")
                                or e.get("part", {}).get("text") or reply)
                rows.append(f"- {name} turn {i}: exit {rc}, {took:.0f} s, prompt tokens "
                            f"{hit + miss}, from the cache {hit} ({share:.1%}); reply "
                            f"{reply[:60]!r}")
                print(rows[-1], flush=True)
                (tmp / f"{name}-{i}.out").write_text(out)
    finally:
        import os

        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        except Exception:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    text = "\n".join(rows) + f"\n(server log and outputs in {tmp})\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
