"""The soak (``harness/soak.py``) for minutes: a real ``promptcache serve`` on a model
folder, ``--streams`` agent-like sessions at once with churn (new sessions, next turns,
a cancelled stream and a hostile request every round), sampling after every round the
server's resident memory, threads, file descriptors, the MLX arrays of its RAM tier and
live states, MLX's active and cached bytes, and the 5xx and 429 / 529 seen.
`promptcache bench --scenarios soak --minutes 30` runs the same soak into a bench report.

    python bench/bench_soak.py --model DIR [--minutes 30] [--streams 8] \\
        [--ram-budget 64MB] [--out soak.json] [--chart soak.png] [-- extra serve args]

Prints a summary (each figure's range after the first ``--warmup`` share of the run) and
writes the samples (JSON) and a chart of them (matplotlib).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from harness.soak import Sample, chart, run_soak


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--ram-budget", default="64MB")
    ap.add_argument("--warmup", type=float, default=0.25, help="share of the run")
    ap.add_argument("--out", default=None)
    ap.add_argument("--chart", default=None)
    ap.add_argument("serve_args", nargs="*")
    a = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="pc-soak-"))
    r = run_soak("ours", a.model, tmp, tmp, streams=a.streams, minutes=a.minutes,
                 max_tokens=a.max_tokens, ram_budget=a.ram_budget, extra_args=a.serve_args,
                 warmup=a.warmup, progress=lambda m: print(m, file=sys.stderr, flush=True))
    if r.get("error"):
        print(f"soak failed: {r['error']} (log: {tmp / 'soak-ours.log'})", file=sys.stderr)
        return 1
    s = r["summary"]
    print(f"{s['rounds']} rounds, {s['requests']} requests in {s['minutes']} min, "
          f"{s['errors_5xx']} 5xx, {s['refused']} refused (429 / 529)")
    print(f"after warm-up: resident {s['rss'][0] / 2**20:.0f}-{s['rss'][1] / 2**20:.0f} MB "
          f"(±{s['rss_spread']:.1%}), threads {s['threads'][0]}-{s['threads'][1]}, fds "
          f"{s['fds'][0]}-{s['fds'][1]}, arrays {s['arrays'][0]}-{s['arrays'][1]}")
    if a.out:
        Path(a.out).write_text(json.dumps(r["samples"]))
    if a.chart:
        chart([Sample(**x) for x in r["samples"]], Path(a.chart))
    return 0


if __name__ == "__main__":
    sys.exit(main())
