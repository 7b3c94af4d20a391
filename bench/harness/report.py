"""Bench results: the summary figures, JSON, a Markdown report and PNG charts.

The results are one JSON-able dict::

    {"meta": {...environment...}, "config": {...},
     "scenarios": {"S1": {"title", "api", "kv_bytes_per_token",
                          "floor": [FloorTurn dicts],
                          "runs": {"ours": SystemRun dict, ...}}}}

``summarize`` derives the figures of one scenario (pure, tested); ``markdown`` and
``write_charts`` render them.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .runner import bytes_held_from_stats

PEERS = ("mlx_lm", "vllm_mlx")
TARGET_VS_PEER = 0.8
TARGET_VS_FLOOR = 1.10
_CHART_STYLE = {"ours": "C0", "mlx_lm": "C1", "vllm_mlx": "C2", "nocache": "C3"}


def environment(model: str) -> dict[str, Any]:
    """What the numbers depend on: BLAS preload, versions, CPU (never changes the env)."""
    from importlib.metadata import PackageNotFoundError, version

    versions: dict[str, str | None] = {}
    for pkg in ("mlx", "mlx-lm", "promptcache"):
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            versions[pkg] = None
    return {
        "model": model,
        "LD_PRELOAD": os.environ.get("LD_PRELOAD", ""),
        "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE", ""),
        "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS", ""),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "versions": versions,
    }


def _ok_turns(run: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [t for t in run.get("turns", []) if t.get("ok")]


def summarize(scn: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per system: Σ TTFT, ratios to the floor and to the best peer, hit rate, memory."""
    floor = list(scn.get("floor") or [])
    floor_sum = sum(f["floor_s"] for f in floor) if floor else None
    runs: Mapping[str, Any] = scn.get("runs") or {}
    kv_per_token = scn.get("kv_bytes_per_token")
    out: dict[str, dict[str, Any]] = {}
    for name, run in runs.items():
        turns = run.get("turns", [])
        ok = _ok_turns(run)
        complete = bool(turns) and len(ok) == len(turns) and not run.get("error")
        s: dict[str, Any] = {
            "complete": complete,
            "turns": len(turns),
            "failed_turns": len(turns) - len(ok),
            "error": run.get("error"),
            "sum_ttft_s": sum(t["ttft_s"] for t in ok) if ok else None,
            "sum_total_s": sum(t["total_s"] for t in ok) if ok else None,
            "peak_rss": run.get("peak_rss", 0),
            "disk_bytes": run.get("disk_bytes", 0),
        }
        prompt = [t.get("prompt_tokens") for t in ok]
        cached = [t.get("cached_tokens") for t in ok]
        if ok and all(isinstance(c, int) for c in cached) and all(isinstance(p, int) and p > 0
                                                                   for p in prompt):
            s["hit_rate"] = sum(cached) / sum(prompt)  # type: ignore[arg-type]
        else:
            s["hit_rate"] = None
        s["vs_floor"] = (s["sum_ttft_s"] / floor_sum
                         if complete and floor_sum else None)
        ratios = []
        if complete and len(floor) == len(turns):
            ratios = [t["ttft_s"] / f["floor_s"] for t, f in zip(turns, floor, strict=True)
                      if f["cached_tokens"] > 0 and f["floor_s"] > 0]
        s["cached_turn_vs_floor_median"] = statistics.median(ratios) if ratios else None
        s["cached_turn_vs_floor_max"] = max(ratios) if ratios else None
        if scn.get("measure_bytes") and kv_per_token:
            unique = sum(f["new_tokens"] for f in floor) + sum(
                int(t.get("completion_tokens") or 0) for t in ok)
            held = bytes_held_from_stats(run.get("cache_stats"))
            source = "cache stats"
            if held is None:
                held = max(0, run.get("rss_at_end", 0) - run.get("rss_after_warmup", 0))
                held += run.get("disk_bytes", 0)
                source = "RSS growth + disk"
            s["unique_kv_bytes"] = unique * kv_per_token
            s["bytes_held"] = held
            s["bytes_held_source"] = source
            s["held_vs_unique"] = held / (unique * kv_per_token) if unique else None
        out[name] = s
    peer_sums = [out[p]["sum_ttft_s"] for p in PEERS if p in out and out[p]["complete"]]
    best_peer = min(peer_sums) if peer_sums else None
    for s in out.values():
        s["vs_best_peer"] = (s["sum_ttft_s"] / best_peer
                             if best_peer and s["complete"] else None)
    if "ours" in out:
        o = out["ours"]
        o["target_vs_peer_met"] = (o["vs_best_peer"] <= TARGET_VS_PEER
                                   if o["vs_best_peer"] is not None else None)
        med = o["cached_turn_vs_floor_median"]
        o["target_vs_floor_met"] = med <= TARGET_VS_FLOOR if med is not None else None
    return out


def write_json(results: Mapping[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _fmt(v: Any, kind: str) -> str:
    if v is None:
        return "—"
    if kind == "s":
        return f"{v:.2f}"
    if kind == "x":
        return f"{v:.2f}×"
    if kind == "pct":
        return f"{100 * v:.0f}%"
    if kind == "mb":
        return f"{v / 2**20:.0f}" if v >= 10 * 2**20 or v == 0 else f"{v / 2**20:.1f}"
    if kind == "yn":
        return "yes" if v else "**no**"
    return str(v)


def markdown(results: Mapping[str, Any], command: str = "") -> str:
    """The report: environment, then one table per scenario (command above each)."""
    meta = results.get("meta", {})
    lines = [
        f"Model: `{meta.get('model')}`; mlx {meta.get('versions', {}).get('mlx')}, "
        f"mlx-lm {meta.get('versions', {}).get('mlx-lm')}; {meta.get('cpu_count')} CPUs; "
        f"LD_PRELOAD=`{meta.get('LD_PRELOAD') or '(none)'}`; "
        f"OPENBLAS_CORETYPE=`{meta.get('OPENBLAS_CORETYPE') or '(unset)'}`; "
        f"max_tokens {results.get('config', {}).get('max_tokens')}, temperature 0.",
        "",
    ]
    for name, scn in results.get("scenarios", {}).items():
        summary = scn.get("summary") or summarize(scn)
        floor = scn.get("floor") or []
        lines += [f"### {name}: {scn.get('title', '')}", ""]
        own = scn.get("max_tokens")
        if own is not None and own != results.get("config", {}).get("max_tokens"):
            lines += [f"max_tokens {own} in this scenario.", ""]
        if command:
            lines += ["```", f"{command} --scenarios {name}", "```", ""]
        lines += [
            "| system | Σ TTFT s | ÷ best peer | ÷ Σ floor | cached turn ÷ floor (median / max) "
            "| token hit rate | peak RSS MB | disk MB | failed turns |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for sys_name, s in summary.items():
            lines.append(
                f"| {sys_name} | {_fmt(s['sum_ttft_s'], 's')} | {_fmt(s['vs_best_peer'], 'x')} "
                f"| {_fmt(s['vs_floor'], 'x')} | {_fmt(s['cached_turn_vs_floor_median'], 'x')} / "
                f"{_fmt(s['cached_turn_vs_floor_max'], 'x')} | {_fmt(s['hit_rate'], 'pct')} "
                f"| {_fmt(s['peak_rss'], 'mb')} | {_fmt(s['disk_bytes'], 'mb')} "
                f"| {s['failed_turns']}{' (' + str(s['error'])[:80] + ')' if s['error'] else ''} |")
        if floor:
            lines.append(f"| floor | {sum(f['floor_s'] for f in floor):.2f} | | 1.00× | 1.00× "
                         f"| {_fmt(_floor_hit_rate(floor), 'pct')} | | | |")
        if scn.get("measure_bytes"):
            lines += ["", "| system | bytes held MB | unique KV MB | held ÷ unique | source |",
                      "|---|---|---|---|---|"]
            for sys_name, s in summary.items():
                if "bytes_held" in s:
                    lines.append(f"| {sys_name} | {_fmt(s['bytes_held'], 'mb')} "
                                 f"| {_fmt(s['unique_kv_bytes'], 'mb')} "
                                 f"| {_fmt(s['held_vs_unique'], 'x')} | {s['bytes_held_source']} |")
        if scn.get("measure_decode"):
            lines += ["", "| system | completion tokens | decode s (after the first token) "
                          "| tok/s |", "|---|---|---|---|"]
            for sys_name, run in (scn.get("runs") or {}).items():
                tokens, secs, rate = decode_rate(run.get("turns") or [])
                lines.append(f"| {sys_name} | {tokens} | {_fmt(secs, 's')} "
                             f"| {'—' if rate is None else f'{rate:.1f}'} |")
        ours = summary.get("ours")
        if ours and ours.get("target_vs_peer_met") is not None:
            lines += ["", f"Targets: Σ TTFT ≤ {TARGET_VS_PEER} × best peer: "
                          f"{_fmt(ours['target_vs_peer_met'], 'yn')}; cached-turn TTFT ≤ "
                          f"{TARGET_VS_FLOOR} × floor (median): "
                          f"{_fmt(ours.get('target_vs_floor_met'), 'yn')}."]
        for skipped, why in (scn.get("skipped") or {}).items():
            lines.append(f"\n{skipped}: not run ({why}).")
        lines.append("")
    return "\n".join(lines)


def decode_rate(turns: Sequence[Mapping[str, Any]]) -> tuple[int, float | None, float | None]:
    """(completion tokens, seconds after each turn's first token, tokens per second after
    the first) over the successful turns of one run."""
    tokens, secs = 0, 0.0
    for t in turns:
        if t.get("ok") and t.get("completion_tokens") and t.get("total_s") is not None \
                and t.get("ttft_s") is not None:
            tokens += int(t["completion_tokens"])
            secs += float(t["total_s"]) - float(t["ttft_s"])
    after_first = tokens - sum(1 for t in turns if t.get("ok") and t.get("completion_tokens"))
    if not tokens:
        return 0, None, None
    return tokens, secs, (after_first / secs if secs > 0 else None)


def _floor_hit_rate(floor: Sequence[Mapping[str, Any]]) -> float | None:
    total = sum(f["prompt_tokens"] for f in floor)
    return sum(f["cached_tokens"] for f in floor) / total if total else None


def write_charts(results: Mapping[str, Any], out_dir: Path, dpi: int = 72) -> list[Path]:
    """One small PNG per scenario: TTFT per request, one line per system, plus the floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, scn in results.get("scenarios", {}).items():
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        for sys_name, run in (scn.get("runs") or {}).items():
            pts = [(i + 1, t["ttft_s"] * 1000) for i, t in enumerate(run.get("turns", []))
                   if t.get("ok")]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, marker=".", label=sys_name, color=_CHART_STYLE.get(sys_name))
        floor = scn.get("floor") or []
        if floor:
            ax.plot(range(1, len(floor) + 1), [f["floor_s"] * 1000 for f in floor], "k--",
                    label="floor")
        runs: Mapping[str, Any] = scn.get("runs") or {}
        first: Mapping[str, Any] = next(iter(runs.values()), {})
        for i, t in enumerate(first.get("turns", [])):
            if t.get("before"):
                ax.axvline(i + 1, color="grey", lw=0.8, ls=":")
        ax.set_title(textwrap.fill(f"{name}: {scn.get('title', '')}", 75), fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("request")
        ax.set_ylabel("TTFT ms")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"{name.lower()}_ttft.png"
        fig.savefig(path, dpi=dpi)
        plt.close(fig)
        paths.append(path)
    return paths


def kv_bytes_per_token_or_none(model_dir: str) -> int | None:
    """``floor.kv_bytes_per_token`` without failing the bench (None when unknown)."""
    from .floor import kv_bytes_per_token

    try:
        return kv_bytes_per_token(model_dir)
    except ValueError:
        return None
