"""`promptcache bench`: replay S1..S5 (and E1, the edit; E2-E5, speculation's cases at 1
and 8 streams) against ours and the peers, with the floor; or soak ours for minutes.

Writes <out>/results.json, <out>/report.md and <out>/charts/*.png, printing progress as
it goes. On Linux the command preloads OpenBLAS itself when it is installed (for the
peers too: they inherit it; ``PROMPTCACHE_NO_OPENBLAS=1`` measures without); the
environment is recorded in the results.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

from promptcache.cli.progress import progress_bar

from . import concurrency, concurrent_plans, redisproc, report, scenarios, soak, systems
from .runner import run_scenario

DEFAULT_MAX_TOKENS = 16


def max_tokens_for(args: argparse.Namespace, s: scenarios.Scenario | None = None) -> int:
    """``--max-tokens`` when given, else the scenario's own length, else the default."""
    if args.max_tokens is not None:
        return int(args.max_tokens)
    if s is not None and s.max_tokens is not None:
        return s.max_tokens
    return DEFAULT_MAX_TOKENS


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("bench", help="benchmark S1..S5, E1 against mlx_lm.server / vllm-mlx",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios",
                   default=",".join(scenarios.SCENARIO_NAMES + concurrent_plans.DEFAULT_CONCURRENT),
                   help="comma-separated, from S1,S2,S3,S4,S5 (sequential), E1 (edit: a "
                        "file returned with one identifier renamed), C1 (1/4/8/16 "
                        "concurrent streams), C2 (main + 3 subagents), E2 / E3 / E4 / E5 "
                        "(speculation's cases at 1 and 8 streams: edit, agentic replay with "
                        "tool calls, chat with nothing to copy, the edit's next turn; only "
                        "when named), S6 (two "
                        "servers sharing one Redis; needs redis-server; only when named), "
                        "soak (agent sessions with churn for --minutes, sampling memory, "
                        "MLX arrays, threads and fds; ours only; only when named), "
                        "long (one conversation grown to --long-sizes tokens, each size's "
                        "next turn from the live state, the RAM tier, the SSD after a "
                        "restart, Redis, beside the floor and mlx_lm.server; only when "
                        "named); default: all the others")
    p.add_argument("--systems", default=",".join(systems.SYSTEM_NAMES),
                   help="comma-separated, from ours,mlx_lm,vllm_mlx,nocache (default: all) "
                        "and ours_kv8,ours_kv4 (ours with --kv-bits 8 / 4), ours_nospec "
                        "(ours with --speculation off: the baseline of E1-E5), ours_spec "
                        "(ours with --speculation suffix, the default, named)")
    p.add_argument("--model", default=None,
                   help="MLX model folder (default: the embedded default model)")
    p.add_argument("--out", default="bench/out", help="output folder (default: bench/out)")
    p.add_argument("--quick", action="store_true", help="small scenarios for a smoke run")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"tokens generated per turn (default: {DEFAULT_MAX_TOKENS}; E1-E5: "
                        "their own, 160)")
    p.add_argument("--seed", type=int, default=0, help="scenario text seed")
    p.add_argument("--streams", default=None,
                   help="C1's stream counts, comma-separated (default: 1,4,8,16; E2-E5: "
                        "1,8)")
    p.add_argument("--floor-repeats", type=int, default=2, help="best of N floor timings")
    p.add_argument("--no-floor", action="store_true", help="skip the in-process floor")
    p.add_argument("--minutes", type=float, default=30.0,
                   help="soak: how long (default: 30)")
    p.add_argument("--rounds", type=int, default=None,
                   help="soak: a number of rounds instead of --minutes")
    p.add_argument("--soak-streams", type=int, default=8,
                   help="soak: sessions at once (default: 8)")
    p.add_argument("--soak-ram-budget", default="64MB",
                   help="soak: the server's --ram-budget, small so blocks go to the SSD "
                        "tier and come back (default: 64MB)")
    p.add_argument("--soak-redis", action="store_true",
                   help="soak: a redis-server as the shared tier, and the SSD tier at the "
                        "RAM tier's budget, so blocks come back from Redis too")
    p.add_argument("--long-shape", default="small",
                   help="long: the model (small, smollm2-random: random weights, a 128K "
                        "window; smollm2: the embedded default, its window widened to 32K)")
    p.add_argument("--long-sizes", default="8192,16384,32768",
                   help="long: the conversation's sizes in tokens (comma-separated)")
    p.add_argument("--long-new", type=int, default=256, help="long: new tokens per turn")
    p.add_argument("--long-budget-min", type=float, default=15.0,
                   help="long: a size estimated past this many minutes is not measured")
    p.add_argument("--long-redis", action="store_true", help="long: also from Redis")
    p.set_defaults(func=run)


def long_argv(args: argparse.Namespace, wanted: list[str], out: Path) -> list[str]:
    """The long-session scenario's own arguments (``long_run.parser``)."""
    argv = ["--shape", args.long_shape, "--sizes", args.long_sizes,
            "--new", str(args.long_new), "--budget-min", f"{args.long_budget_min:g}",
            "--out", str(out / "long_session.json")]
    return (argv + (["--redis"] if args.long_redis else [])
            + ([] if "mlx_lm" in wanted else ["--no-mlx-lm"]))


def _streams(arg: str | None) -> list[int] | None:
    if not arg:
        return None
    try:
        counts = [int(x) for x in arg.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--streams {arg!r}: comma-separated positive integers") from None
    if not counts or min(counts) < 1:
        raise ValueError(f"--streams {arg!r}: comma-separated positive integers")
    return counts


def _say(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _resolve_model(arg: str | None) -> str:
    if arg:
        path = Path(arg).expanduser()
        if not (path / "config.json").is_file():
            raise ValueError(f"--model {arg}: no config.json there (an MLX model folder is needed)")
        return str(path.resolve())
    try:
        from promptcache.engine.models.gguf import ensure_default_model

        return str(ensure_default_model())
    except Exception as e:  # noqa: BLE001 - any failure: tell the user to pass --model
        raise ValueError("no --model given and the default model is not available "
                         f"({type(e).__name__}: {e}); pass --model PATH") from e


def _command(args: argparse.Namespace, model: str) -> str:
    parts = ["promptcache", "bench", "--model", model, "--scenarios", args.scenarios,
             "--systems", args.systems]
    preload = os.environ.get("LD_PRELOAD")
    if preload:
        parts.insert(0, f"LD_PRELOAD={preload}")
    if args.quick:
        parts.append("--quick")
    if args.max_tokens is not None:
        parts += ["--max-tokens", str(args.max_tokens)]
    if getattr(args, "streams", None):
        parts += ["--streams", args.streams]
    if "soak" in args.scenarios.lower():
        parts += (["--rounds", str(args.rounds)] if args.rounds is not None
                  else ["--minutes", f"{args.minutes:g}"])
        parts += ["--soak-streams", str(args.soak_streams),
                  "--soak-ram-budget", args.soak_ram_budget]
        parts += ["--soak-redis"] if args.soak_redis else []
    if "long" in args.scenarios.lower():
        parts += ["--long-shape", args.long_shape, "--long-sizes", args.long_sizes,
                  "--long-new", str(args.long_new)] + (["--long-redis"] if args.long_redis else [])
    return " ".join(p if p.startswith("LD_PRELOAD=") else shlex.quote(p) for p in parts)


def _terminate(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through the servers' stop()


def run(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _terminate)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    parts = [p.strip().upper() for p in args.scenarios.split(",") if p.strip()]
    want_s6, want_soak, want_long = "S6" in parts, "SOAK" in parts, "LONG" in parts
    concurrent = [p for p in dict.fromkeys(parts) if p in concurrent_plans.CONCURRENT_NAMES]
    rest = [p for p in parts
            if p not in ("S6", "SOAK", "LONG") and p not in concurrent_plans.CONCURRENT_NAMES]
    names = (scenarios.parse_names(",".join(rest))
             if rest or not (want_s6 or want_soak or want_long or concurrent) else [])
    wanted = systems.parse_systems(args.systems)
    if args.max_tokens is not None and not 0 < args.max_tokens <= 4096:
        raise ValueError(f"--max-tokens must be in 1..4096, got {args.max_tokens}")
    if want_soak:
        _check_soak(args)
    model = _resolve_model(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kv_per_token = report.kv_bytes_per_token_or_none(model)
    scns = [scenarios.build(n, quick=args.quick, seed=args.seed) for n in names]
    results: dict[str, Any] = {
        "meta": report.environment(model),
        "config": {"quick": args.quick, "max_tokens": max_tokens_for(args), "seed": args.seed,
                   "systems": wanted, "scenarios": names + concurrent},
        "scenarios": {},
        "concurrent": {},
    }
    meta = results["meta"]
    _say(f"model {model}; LD_PRELOAD={meta['LD_PRELOAD'] or '(none)'} "
         f"OPENBLAS_CORETYPE={meta['OPENBLAS_CORETYPE'] or '(unset)'}")
    for s in scns:
        results["scenarios"][s.name] = {
            "title": s.title, "api": s.api, "notes": list(s.notes),
            "measure_bytes": s.measure_bytes, "measure_decode": s.measure_decode,
            "kv_bytes_per_token": kv_per_token,
            "num_requests": len(s.turns), "num_conversations": s.num_conversations,
            "max_tokens": max_tokens_for(args, s),
            "floor": [], "runs": {}, "skipped": {},
        }
    if not args.no_floor and scns:
        from .floor import FloorMeter

        _say("floor: loading the model in-process")
        meter = FloorMeter(model, repeats=args.floor_repeats)
        for s in scns:
            t0 = time.perf_counter()
            floor = meter.measure(s, progress=_say)
            results["scenarios"][s.name]["floor"] = [f.to_dict() for f in floor]
            _say(f"floor {s.name}: {len(floor)} turns, Σ {sum(f.floor_s for f in floor):.2f} s "
                 f"(measured in {time.perf_counter() - t0:.0f} s)")
        del meter
        gc.collect()
    results_path = out / "results.json"
    for s in scns:
        scn = results["scenarios"][s.name]
        budget = _ram_budget(s, scn, kv_per_token)
        scn["ram_budget_bytes"] = budget
        for name in wanted:
            why = systems.unavailable_reason(name)
            if why:
                scn["skipped"][name] = why
                _say(f"{s.name}/{name}: skipped: {why}")
                continue
            _say(f"{s.name}/{name}: {len(s.turns)} requests"
                 + (f", RAM budget {budget / 2**20:.1f} MB" if budget else ""))
            with progress_bar(f"{s.name}/{name}") as bar:
                r = run_scenario(name, s, model, out / "work", out / "logs",
                                 max_tokens=max_tokens_for(args, s), ram_budget_bytes=budget,
                                 progress=_say, turn_progress=bar)
            scn["runs"][name] = r.to_dict()
            if r.error:
                _say(f"{s.name}/{name}: ERROR {r.error}")
            scn["summary"] = report.summarize(scn)
            report.write_json(results, results_path)
        scn["summary"] = report.summarize(scn)
        for name, summ in scn["summary"].items():
            sum_ttft = summ["sum_ttft_s"]
            _say(f"{s.name}/{name}: Σ TTFT {_num(sum_ttft, ' s')}, ÷ floor "
                 f"{_num(summ['vs_floor'], '×')}, ÷ best peer {_num(summ['vs_best_peer'], '×')}")
    md_concurrent = _run_concurrent(args, concurrent, wanted, model, out, results, results_path)
    report.write_json(results, results_path)
    s6_md = ""
    if want_s6:
        from . import shared

        results["s6"] = shared.run_s6(model, out / "work", out / "logs", wanted, quick=args.quick,
                                      seed=args.seed, max_tokens=max_tokens_for(args),
                                      progress=_say)
        report.write_json(results, results_path)
        s6_md = "\n" + shared.markdown(results["s6"])
    soak_md = _run_soak(args, wanted, model, out, results, results_path) if want_soak else ""
    long_md = ""
    if want_long:
        from .long_run import run as run_long

        long_md = (f"\n## Long sessions\n\n`{_command(args, model)}`\n\n"
                   + run_long(long_argv(args, wanted, out)) + "\n")
    md = (report.markdown(results, _command(args, model)) + s6_md + md_concurrent + soak_md
          + long_md)
    (out / "report.md").write_text(md)
    charts = report.write_charts(results, out / "charts")
    _say(f"wrote {results_path}, {out / 'report.md'}, {len(charts)} charts in {out / 'charts'}")
    print(md)
    return 0


def _run_concurrent(args: argparse.Namespace, names: list[str], wanted: list[str], model: str,
                    out: Path, results: dict[str, Any], results_path: Path) -> str:
    """C1 / C2: every system's server up at once, the systems take turns round by round
    (``concurrency.run_plans``); returns their Markdown."""
    md = ""
    for name in names:
        plan = concurrent_plans.build(name, quick=args.quick, seed=args.seed,
                                 streams=_streams(args.streams))
        max_tokens = (concurrent_plans.output_tokens(args.quick) if name == "C1"
                      else plan.max_tokens if plan.max_tokens is not None
                      and args.max_tokens is None else max_tokens_for(args))
        entry: dict[str, Any] = {"title": plan.title, "api": plan.api, "max_tokens": max_tokens,
                                 "runs": {}, "skipped": {}}
        results["concurrent"][name] = entry
        ready = []
        for system in wanted:
            why = systems.unavailable_reason(system)
            if why:
                entry["skipped"][system] = why
            else:
                ready.append(system)
        _say(f"{name} ({', '.join(ready)} interleaved): {plan.title}")
        entry["runs"] = concurrency.run_plans(ready, plan, model, out / "work", out / "logs",
                                              max_tokens=max_tokens, progress=_say)
        report.write_json(results, results_path)
        md += "\n" + concurrency.markdown(name, plan.title, entry["runs"])
    return md


def _check_soak(args: argparse.Namespace) -> None:
    if args.rounds is not None and args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    if args.rounds is None and not args.minutes > 0:
        raise ValueError(f"--minutes must be > 0, got {args.minutes}")
    if not 1 <= args.soak_streams <= 256:
        raise ValueError(f"--soak-streams must be in 1..256, got {args.soak_streams}")
    if args.soak_redis and redisproc.REDIS_SERVER is None:
        raise ValueError("--soak-redis: redis-server (or valkey-server) is not installed")


def _run_soak(args: argparse.Namespace, wanted: list[str], model: str, out: Path,
              results: dict[str, Any], results_path: Path) -> str:
    """The soak on each of ``wanted`` that is ours (it reads ``/v1/cache/stats``); its
    samples in results.json, a chart per system, its Markdown."""
    entry: dict[str, Any] = {"runs": {}, "skipped": {}}
    results["soak"] = entry
    for system in wanted:
        if system not in systems.OURS:
            entry["skipped"][system] = "the soak reads ours' /v1/cache/stats"
            continue
        length = (f"{args.rounds} rounds" if args.rounds is not None
                  else f"{args.minutes:g} minutes")
        _say(f"soak/{system}: {args.soak_streams} streams for {length}")
        r = soak.run_soak(system, model, out / "work", out / "logs", streams=args.soak_streams,
                          minutes=None if args.rounds is not None else args.minutes,
                          rounds=args.rounds, max_tokens=max_tokens_for(args),
                          ram_budget=args.soak_ram_budget, redis=args.soak_redis,
                          progress=_say)
        entry["runs"][system] = r
        if r.get("error"):
            _say(f"soak/{system}: ERROR {r['error']}")
        else:
            soak.chart([soak.Sample(**x) for x in r["samples"]],
                       out / "charts" / f"soak_{system}.png")
    report.write_json(results, results_path)
    return "\n" + soak.markdown(entry["runs"], entry["skipped"], _command(args, model))


def _num(v: float | None, unit: str) -> str:
    return "—" if v is None else f"{v:.2f}{unit}"


def _ram_budget(s: scenarios.Scenario, scn: dict[str, Any], kv_per_token: int | None) -> int | None:
    """S3's budget: a fraction of the scenario's total KV (unique prompt + generated tokens)."""
    if s.ram_budget_fraction is None or not kv_per_token:
        return None
    floor = scn.get("floor") or []
    if floor:
        tokens = sum(f["new_tokens"] for f in floor)
    else:  # no floor: ~4 characters per token over each conversation's last request
        last = {t.conversation: t for t in s.turns}
        tokens = sum(sum(len(str(m.get("content") or "")) for m in t.messages) // 4
                     for t in last.values())
    return max(1, int(s.ram_budget_fraction * tokens * kv_per_token))
