"""Speculative decoding from history, on vs off, in process (one greedy stream).

Scenarios: "edit" (the model is asked to return a Python module from its prompt with one
class renamed: most of the reply copies the prompt) and "chat" (a short poem: nothing to
copy). Each mode runs twice, interleaved (off, suffix, off, suffix), so machine load hits
both alike. Reports decode tok/s, the forwards per reply (decode steps: the quantity
speculation reduces, independent of the machine's load), drafted / accepted tokens, and
whether the tokens equal those of the run without speculation.

Usage: .venv/bin/python bench/bench_speculation.py [--max-tokens 160] [--model PATH]
(with OpenBLAS: LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0)
"""

from __future__ import annotations

import argparse
import inspect
from typing import Any

from promptcache.config import CacheConfig, EngineConfig
from promptcache.engine import drafts as drafts_module
from promptcache.engine.engine import Engine
from promptcache.engine.models.gguf import ensure_default_model


def scenarios() -> dict[str, list[dict[str, Any]]]:
    source = inspect.getsource(drafts_module)[:3000]
    return {
        "edit": [{"role": "user", "content": "Here is a Python module:\n\n```python\n" + source
                  + "\n```\n\nRewrite the module exactly, but rename the class SequenceDrafts "
                  "to HistoryDrafts. Output only the code."}],
        "chat": [{"role": "user", "content": "Write a short poem about the sea and the wind."}],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-draft", type=int, default=8)
    ap.add_argument("--min-match", type=int, default=3)
    args = ap.parse_args()
    path = args.model or ensure_default_model()
    reference: dict[str, list[int]] = {}
    for mode in ("off", "suffix", "off", "suffix"):
        cfg = EngineConfig(speculation=mode, spec_max_draft=args.max_draft,
                           spec_min_match=args.min_match)
        eng = Engine.load(path, cfg, CacheConfig(), cache=None)
        try:
            for name, messages in scenarios().items():
                tokens = eng.render_chat(messages)
                eng.generate(tokens, max_tokens=4)  # warm-up
                before = eng.counters.to_dict()
                r = eng.generate(tokens, max_tokens=args.max_tokens)
                after = eng.counters.to_dict()
                d = {k: after[k] - before[k] for k in
                     ("decode_steps", "spec_drafted", "spec_accepted")}
                same = reference.setdefault(name, r.tokens) == r.tokens
                print(f"{mode:6s} {name:4s} prompt {len(tokens):4d}  tokens {len(r.tokens)}  "
                      f"decode {len(r.tokens) / r.decode_s:6.2f} tok/s  "
                      f"forwards {d['decode_steps']:3d}  drafted {d['spec_drafted']:3d}  "
                      f"accepted {d['spec_accepted']:3d}  identical {same}", flush=True)
        finally:
            eng.close()


if __name__ == "__main__":
    main()
