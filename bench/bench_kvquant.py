"""KV quantization of cached blocks: bytes per token, quality, SSD restore (a script,
not a test). Parts (``--parts``, default all), full precision vs ``--kv-bits 8`` vs ``4``:

* ``bytes``: bytes and arrays per cached token of one stored 64-token block (SmolLM2 as
  served and cast to float16, the tiny test llamas);
* ``quality``: chat prompts restored and continued: max |dlogits| of the first token and
  top-1 agreement over ``--steps`` teacher-forced steps (the full-precision restore is the
  method's noise floor);
* ``ppl``: perplexity of a text read in 256-token turns, each restored from the blocks so far;
* ``ssd``: the ~200 MB prefix of ``bench/bench_ssd.py`` restored from the SSD (cold, warm) and
  from RAM; bytes on disk.

Group 64; ``min_tokens`` 0 (every block quantized) unless the row says m256 (the default).

usage: LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
    python bench/bench_kvquant.py [--parts bytes,quality,ppl,ssd] [--model DIR]
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from promptcache.engine.payload import adapters
from promptcache.engine.payload.adapters import BlockSpan, extract_block, restore
from promptcache.engine.payload.quant import KVQuant

BLOCK = 64
CHUNK = 256
VARIANTS: dict[str, KVQuant | None] = {
    "fp": None, "q8": KVQuant(8, 64, 0), "q4": KVQuant(4, 64, 0),
    "q8 m256": KVQuant(8, 64, 256), "q4 m256": KVQuant(4, 64, 256),
}
# Standard-library modules with long docstrings: the prompts and the perplexity text.
PROMPT_MODULES = (
    "abc argparse ast asyncio base64 bdb binascii bisect bz2 calendar cmd code codecs "
    "collections colorsys compileall concurrent.futures configparser contextlib contextvars "
    "copy copyreg csv ctypes dataclasses datetime decimal difflib dis doctest email enum "
    "filecmp fileinput fnmatch fractions ftplib functools gc getopt getpass gettext glob "
    "graphlib gzip hashlib heapq hmac html http.client http.cookies imaplib inspect io "
    "ipaddress itertools json keyword linecache locale logging lzma mailbox math mimetypes "
    "mmap modulefinder multiprocessing netrc numbers operator optparse os pathlib pdb "
    "pickle pickletools pkgutil platform plistlib poplib pprint profile pstats pty "
    "py_compile pydoc queue quopri random re reprlib rlcompleter runpy sched secrets "
    "selectors shelve shlex shutil signal site smtplib socket socketserver sqlite3 ssl "
    "stat statistics string struct subprocess symtable sys sysconfig tabnanny tarfile "
    "tempfile textwrap threading timeit tokenize tomllib trace traceback tracemalloc "
    "turtle types typing unittest urllib.parse uuid venv warnings wave weakref "
    "webbrowser xml.dom zipapp zipfile zipimport zoneinfo"
).split()


def say(msg: str) -> None:
    print(msg, flush=True)


def load_avg() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def module_doc(name: str, max_chars: int) -> str:
    """The module docstring plus its public callables' docstrings, up to ``max_chars``."""
    import inspect

    try:
        mod = importlib.import_module(name)
    except Exception:  # noqa: BLE001 - a module missing on this build is skipped
        return ""
    parts = [inspect.getdoc(mod) or ""]
    for attr in sorted(getattr(mod, "__all__", None) or dir(mod)):
        if attr.startswith("_"):
            continue
        obj = getattr(mod, attr, None)
        if callable(obj) and getattr(obj, "__module__", None) == mod.__name__:
            doc = inspect.getdoc(obj)
            if doc:
                parts.append(f"{attr}: {doc}")
        if sum(len(p) for p in parts) > max_chars:
            break
    return "\n\n".join(p for p in parts if p)[:max_chars]


def prompts(tokenizer: Any, n: int, max_chars: int) -> list[list[int]]:
    out = []
    for name in PROMPT_MODULES:
        doc = module_doc(name, max_chars)
        if len(doc) < max_chars // 2:
            continue
        messages = [{"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": f"Explain what the Python module `{name}` does, "
                                                f"from its documentation:\n\n{doc}"}]
        out.append([int(t) for t in tokenizer.apply_chat_template(messages, add_generation_prompt=True)])
        if len(out) == n:
            break
    return out


def prefill(model: Any, tokens: Sequence[int]) -> tuple[list[Any], mx.array]:
    """A chunked prefill from position 0, as the engine does it."""
    caches = make_prompt_cache(model)
    logits = None
    for i in range(0, len(tokens), CHUNK):
        logits = model(mx.array(tokens[i : i + CHUNK])[None], cache=caches)
        mx.eval(logits, [a for _, a in adapters.state_arrays(caches)])
    assert logits is not None
    return caches, logits[0]


def blocks_of(caches: list[Any], start: int, end: int, quant: KVQuant | None) -> list[tuple[BlockSpan, Any]]:
    return [(BlockSpan(s, min(s + BLOCK, end)), extract_block(caches, s, min(s + BLOCK, end), False, quant=quant))
            for s in range(start, end, BLOCK)]


# ---------------------------------------------------------------- bytes


def part_bytes(args: argparse.Namespace, smol: Path, tiny: Path | None, tiny64: Path | None) -> dict[str, Any]:
    rows = []
    models: list[tuple[str, Path, Any]] = [("SmolLM2-135M (float32, as served)", smol, None),
                                           ("SmolLM2-135M cast to float16", smol, mx.float16)]
    if tiny64 is not None:
        models.append(("tiny llama, head_dim 64 (float32)", tiny64, None))
    if tiny is not None:
        models.append(("tiny llama, head_dim 16 (float32)", tiny, None))
    for label, path, dtype in models:
        model, _ = load(str(path))
        if dtype is not None:
            model.set_dtype(dtype)
        caches, _ = prefill(model, list(range(10, 10 + BLOCK)))
        kv_dtype = str(caches[0].keys.dtype).replace("mlx.core.", "")
        sizes = {}
        for name, quant in (("fp", None), ("q8", VARIANTS["q8"]), ("q4", VARIANTS["q4"])):
            p = extract_block(caches, 0, BLOCK, False, quant=quant)
            sizes[name] = p.nbytes / BLOCK
            if name == "fp":
                tensors = len(p)
        q_tensors = len(extract_block(caches, 0, BLOCK, False, quant=VARIANTS["q8"]))
        fp16 = sizes["fp"] * 2 / caches[0].keys.dtype.size
        rows.append({"model": label, "kv_dtype": kv_dtype, "layers": len(caches),
                     "bytes_per_token": sizes, "vs_fp": {k: v / sizes["fp"] for k, v in sizes.items()},
                     "vs_fp16": {k: v / fp16 for k, v in sizes.items()},
                     "tensors_per_block": {"fp": tensors, "q8": q_tensors}})
        del model
    return {"rows": rows}


# ---------------------------------------------------------------- quality


def _quality_row(model: Any, p: list[int], steps: int, variants: dict[str, KVQuant | None]
                 ) -> dict[str, Any]:
    """One prompt: the full-precision greedy reference, then each variant's restore fed
    the same tokens (teacher forcing)."""
    caches, _ = prefill(model, p[:-1])
    n = len(p) - 1
    stored = {v: blocks_of(caches, 0, n, q) for v, q in variants.items()}
    # the full-precision reference: the live cache, greedy, step by step
    out = model(mx.array([[p[-1]]]), cache=caches)[0, -1]
    ref0 = np.array(out.astype(mx.float32))
    toks = [int(mx.argmax(out))]
    for _ in range(steps - 1):
        out = model(mx.array([[toks[-1]]]), cache=caches)[0, -1]
        toks.append(int(mx.argmax(out)))
    del caches
    feed = mx.array([[p[-1], *toks[:-1]]])
    row: dict[str, Any] = {"tokens": len(p), "variants": {}}
    for v, blocks in stored.items():
        r = restore(model, blocks, n, reserve=steps)
        lg = np.array(model(feed, cache=r)[0].astype(mx.float32))
        agree = lg.argmax(axis=-1) == np.array(toks)
        row["variants"][v] = {"dlogit0": float(np.max(np.abs(lg[0] - ref0))),
                              "agree": int(agree.sum()), "steps": int(agree.size)}
    return row


def part_quality(args: argparse.Namespace, smol: Path) -> dict[str, Any]:
    """Per-prompt rows go to ``--rows`` (JSON lines) as they are measured; rows already
    there are kept and their prompts skipped, so a run can be resumed or extended."""
    model, tok = load(str(smol))
    variants = {v: VARIANTS[v] for v in args.quality_variants.split(",")}
    ps = prompts(tok, args.prompts, args.prompt_chars)
    lens = [len(p) for p in ps]
    say(f"quality: {len(ps)} prompts, {min(lens)}-{max(lens)} tokens (median {statistics.median(lens)}), "
        f"{args.steps} steps, variants {list(variants)}; load {load_avg()}")
    rows: dict[int, dict[str, Any]] = {}
    _read_rows(args, variants, rows)
    t0 = time.perf_counter()
    for i, p in enumerate(ps):
        if i in rows or i < args.first:
            continue
        row = _quality_row(model, p, args.steps, variants)
        row.update(index=i, steps=args.steps)
        rows[i] = row
        if args.rows is not None:
            with args.rows.open("a") as f:  # one line per write: workers may share the file
                f.write(json.dumps(row) + "\n")
        if len(rows) % 10 == 0:
            say(f"  {len(rows)}/{len(ps)} prompts ({time.perf_counter() - t0:.0f} s, load {load_avg()}): "
                + ", ".join(f"{v} top-1 {100 * _agreement(rows.values(), v):.2f}%" for v in variants))
    _read_rows(args, variants, rows)  # and the rows other workers wrote meanwhile
    return summarize_quality(list(rows.values()), variants, len(ps), time.perf_counter() - t0)


def _read_rows(args: argparse.Namespace, variants: Any, rows: dict[int, dict[str, Any]]) -> None:
    """Add the ``--rows`` file's rows of this run's steps and variants (measured ones kept)."""
    if args.rows is not None and args.rows.exists():
        for line in args.rows.read_text().splitlines():
            r = json.loads(line)
            if r["steps"] == args.steps and set(r["variants"]) == set(variants):
                rows.setdefault(r["index"], r)


def _agreement(rows: Any, v: str) -> float:
    rows = list(rows)
    return sum(r["variants"][v]["agree"] for r in rows) / sum(r["variants"][v]["steps"] for r in rows)


def summarize_quality(rows: list[dict[str, Any]], variants: Any, total: int, seconds: float
                      ) -> dict[str, Any]:
    lens = [r["tokens"] for r in rows]
    out_rows = {}
    for v in variants:
        d = [r["variants"][v]["dlogit0"] for r in rows]
        out_rows[v] = {"max_dlogit0_max": max(d), "max_dlogit0_median": statistics.median(d),
                       "max_dlogit0_mean": statistics.mean(d), "top1_agreement": _agreement(rows, v),
                       "prompts_all_steps_agree": sum(r["variants"][v]["agree"] == r["variants"][v]["steps"]
                                                      for r in rows)}
    return {"prompts": len(rows), "of": total,
            "prompt_tokens": {"min": min(lens), "median": statistics.median(lens), "max": max(lens)},
            "steps": rows[0]["steps"], "variants": out_rows, "seconds": seconds}


# ---------------------------------------------------------------- perplexity


def part_ppl(args: argparse.Namespace, smol: Path) -> dict[str, Any]:
    model, tok = load(str(smol))
    text = "\n\n".join(module_doc(m, 6000) for m in PROMPT_MODULES[::3])
    ids = [int(t) for t in tok.encode(text)][: args.ppl_tokens]
    say(f"ppl: {len(ids)} tokens in {CHUNK}-token turns; load {load_avg()}")
    out = {}
    for v in args.ppl_variants.split(","):
        quant = VARIANTS[v]
        t = time.perf_counter()
        blocks: list[tuple[BlockSpan, Any]] = []
        nll = 0.0
        count = 0
        for start in range(0, len(ids), CHUNK):
            end = min(len(ids), start + CHUNK)
            caches = restore(model, blocks, start, reserve=CHUNK) if start else make_prompt_cache(model)
            logits = model(mx.array(ids[start:end])[None], cache=caches)[0].astype(mx.float32)
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            targets = ids[start + 1 : end + 1]
            picked = mx.take_along_axis(lp[: len(targets)], mx.array(targets)[:, None], axis=-1)
            nll -= float(mx.sum(picked))
            count += len(targets)
            blocks += blocks_of(caches, start, end, quant)
        out[v] = {"ppl": math.exp(nll / count), "tokens": count, "seconds": time.perf_counter() - t}
        say(f"  {v}: ppl {out[v]['ppl']:.4f} ({out[v]['seconds']:.0f} s)")
    base = out["fp"]["ppl"]
    for v in out:
        out[v]["change"] = out[v]["ppl"] / base - 1
    return {"tokens": len(ids), "variants": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="bytes,quality,ppl,ssd")
    ap.add_argument("--model", type=Path, default=None, help="SmolLM2 MLX folder (default: the embedded one)")
    ap.add_argument("--tiny-root", type=Path, default=Path(".models"), help="folder of the tiny test models")
    ap.add_argument("--prompts", type=int, default=100)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt-chars", type=int, default=2000)
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="scratch folder for the SSD part")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--rows", type=Path, default=None,
                    help="quality: per-prompt rows (JSON lines; resumed from if present)")
    ap.add_argument("--ppl-variants", default=",".join(VARIANTS),
                    help="ppl: variants to read the text with (fp first: the baseline)")
    ap.add_argument("--first", type=int, default=0,
                    help="quality: start at this prompt (several workers on one --rows file "
                         "each write their own rows; the summary reads all of them)")
    ap.add_argument("--quality-variants", default="fp,q8,q4,q8 m256",
                    help=f"quality: variants to compare (of {', '.join(VARIANTS)})")
    args = ap.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    smol = args.model
    if smol is None:
        from promptcache.engine.models.gguf import ensure_default_model

        smol = ensure_default_model()
    tiny = args.tiny_root / "tiny-llama-v1"
    tiny64 = args.tiny_root / "tiny-llama-hd64-v1"
    say(f"machine: {platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}, Python "
        f"{platform.python_version()}, mlx {mx.__version__}; LD_PRELOAD={os.environ.get('LD_PRELOAD', '')}")
    say(f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load {load_avg()}")
    results: dict[str, Any] = {"argv": sys.argv, "load_start": load_avg()}
    if "bytes" in parts:
        results["bytes"] = part_bytes(args, smol, tiny if tiny.is_dir() else None,
                                      tiny64 if tiny64.is_dir() else None)
        for r in results["bytes"]["rows"]:
            b = r["bytes_per_token"]
            say(f"bytes/token {r['model']}: fp {b['fp']:.0f}, q8 {b['q8']:.0f} ({r['vs_fp']['q8']:.3f}x, "
                f"{r['vs_fp16']['q8']:.3f}x of fp16), q4 {b['q4']:.0f} ({r['vs_fp']['q4']:.3f}x, "
                f"{r['vs_fp16']['q4']:.3f}x of fp16); tensors per block {r['tensors_per_block']}")
    if "quality" in parts:
        results["quality"] = part_quality(args, smol)
        for v, r in results["quality"]["variants"].items():
            say(f"quality {v}: max|dlogits| first token: max {r['max_dlogit0_max']:.4f} median "
                f"{r['max_dlogit0_median']:.4f}; top-1 agreement {100 * r['top1_agreement']:.2f}%; "
                f"{r['prompts_all_steps_agree']} of {results['quality']['prompts']} prompts agree on "
                f"every step")
    if "ppl" in parts:
        results["ppl"] = part_ppl(args, smol)
        for v, r in results["ppl"]["variants"].items():
            say(f"ppl {v}: {r['ppl']:.4f} ({100 * r['change']:+.3f}%)")
    if "ssd" in parts:
        from kvquant_ssd import part_ssd

        results["ssd"] = part_ssd(args)
    results["load_end"] = load_avg()
    say(f"load at the end: {results['load_end']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
