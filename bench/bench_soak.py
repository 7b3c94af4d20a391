"""The soak (``tests/soak.py``) for minutes: a real ``promptcache serve`` on a model
folder, ``--streams`` agent-like sessions at once with churn (new sessions, next turns,
a cancelled stream and a hostile request every round), sampling after every round the
server's resident memory, threads, file descriptors, the MLX arrays of its RAM tier and
live states, MLX's active and cached bytes, and the 5xx and 429 / 529 seen.

    PYTHONPATH=src python bench/bench_soak.py --model DIR [--minutes 30] [--streams 8] \\
        [--ram-budget 64MB] [--out soak.json] [--chart soak.png] [-- extra serve args]

Prints a summary (each figure's range after the first ``--warmup`` share of the run) and
writes the samples (JSON) and a chart of them (matplotlib).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from soak import Sample, run, server  # noqa: E402


def chart(samples: list[Sample], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s.t / 60 for s in samples]
    fig, axes = plt.subplots(2, 2, figsize=(11, 6), sharex=True)
    series = [("resident memory (MB)", [s.rss / 2**20 for s in samples]),
              ("threads / file descriptors", None),
              ("MLX arrays (RAM tier + live states)",
               [s.ram_arrays + s.live_arrays for s in samples]),
              ("MLX active MB", [s.mlx_active / 2**20 for s in samples])]
    for ax, (title, ys) in zip(axes.flat, series, strict=True):
        if title.startswith("resident") and samples[0].parts:
            ax.plot(t, ys, label="total")  # and its parts (tests/soak.py memory_parts)
            for part in samples[0].parts:
                ax.plot(t, [s.parts.get(part, 0) / 2**20 for s in samples], label=part,
                        linewidth=0.8)
            ax.legend(fontsize="small", ncol=2)
        elif ys is None:
            ax.plot(t, [s.threads for s in samples], label="threads")
            ax.plot(t, [s.fds for s in samples], label="fds")
            ax.legend()
        else:
            ax.plot(t, ys)
        ax.set_title(title)
    for ax in axes[1]:
        ax.set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


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
    args = ["--model", a.model, "--cache-dir", str(tmp / "blocks"), "--ram-budget",
            a.ram_budget, *a.serve_args]
    t0 = time.monotonic()

    def progress(s: Sample) -> None:
        if s.round % 20 == 0:
            print(f"[{time.monotonic() - t0:7.1f} s] round {s.round}: rss "
                  f"{s.rss / 2**20:.0f} MB ("
                  + ", ".join(f"{k} {v / 2**20:.0f}" for k, v in s.parts.items())
                  + f"), threads {s.threads}, fds {s.fds}, arrays "
                  f"{s.ram_arrays + s.live_arrays}, requests {s.requests}, 5xx "
                  f"{s.errors_5xx}, refused {s.refused}", file=sys.stderr, flush=True)

    with server(args, tmp / "server.log") as (base, pid):
        samples = run(base, pid, streams=a.streams, minutes=a.minutes,
                      max_tokens=a.max_tokens, on_sample=progress)
    cut = int(len(samples) * a.warmup)
    after = samples[cut:]
    rss = [s.rss for s in after]
    mid = (max(rss) + min(rss)) / 2
    print(f"{len(samples)} rounds, {samples[-1].requests} requests in {a.minutes} min, "
          f"{samples[-1].errors_5xx} 5xx, {samples[-1].refused} refused (429 / 529)")
    print(f"warm-up: the first {a.warmup:.0%} of the run ({cut} rounds, "
          f"{after[0].t / 60:.1f} min)")
    print(f"RSS after warm-up: {min(rss) / 2**20:.0f}-{max(rss) / 2**20:.0f} MB, "
          f"±{(max(rss) - mid) / mid:.1%} around {mid / 2**20:.0f} MB (target ±5%)")
    if after[0].parts:
        print("  by part: " + ", ".join(
            f"{k} {min(s.parts[k] for s in after) / 2**20:.0f}-"
            f"{max(s.parts[k] for s in after) / 2**20:.0f} MB" for k in after[0].parts))
    print(f"after warm-up: threads {min(s.threads for s in after)}-"
          f"{max(s.threads for s in after)}, fds {min(s.fds for s in after)}-"
          f"{max(s.fds for s in after)}, MLX arrays (RAM tier + live states) "
          f"{min(s.ram_arrays + s.live_arrays for s in after)}-"
          f"{max(s.ram_arrays + s.live_arrays for s in after)}, MLX active "
          f"{min(s.mlx_active for s in after) / 2**20:.0f}-"
          f"{max(s.mlx_active for s in after) / 2**20:.0f} MB")
    if a.out:
        Path(a.out).write_text(json.dumps([s.as_dict() for s in samples]))
    if a.chart:
        chart(samples, Path(a.chart))
    return 0


if __name__ == "__main__":
    sys.exit(main())
