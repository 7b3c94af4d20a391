"""TTFT of image prompts: turn 1 vs turn 2 with the same image (a script, not a test).

Random-weight llava models built offline (``tests/models/tiny_vlm.py``; no model can
be downloaded here): ``tiny`` is the test model (32x32 image, 64 placeholder tokens,
a 2-layer vision tower), ``small`` a larger one (224x224, 14-pixel patches: 256
placeholder tokens; 12-layer 384-wide vision tower; 4-layer 256-wide text model).
In-process Engine, greedy, 8 output tokens, block size 16, chunks of 256; for each
model and round, in one run (median of ``--repeat`` rounds, each with new images):

* turn 1: a cold conversation with one new image (prompt cache miss, vision miss);
* turn 2: the same conversation + the reply + a new user line (prompt cache hit over
  the image: 0 vision tower calls);
* same image, other text: the image after other words (the prompt cache misses from
  the start; the vision-embedding cache supplies the features);
* turn 2 without any cache (``use_cache`` off, no vision cache): the full prefill.

usage: python bench/bench_vlm.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from promptcache.cli.wiring import build_cache
from promptcache.config import CacheConfig
from promptcache.engine.api import (
    GenerationRequest,
    SamplingParams,
    expand_placeholders,
    image_digest,
)
from promptcache.engine.engine import Engine
from promptcache.engine.models.vision_cache import VisionCache
from promptcache.serving_config import EngineConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tiny test models
from models.tiny_vlm import build_tiny_vlm  # noqa: E402

SIZES: dict[str, dict[str, int]] = {
    "tiny": {},
    "small": {"image_size": 224, "patch_size": 14, "vision_layers": 12, "vision_hidden": 384,
              "text_layers": 4, "text_hidden": 256},
}
SYSTEM = {"role": "system", "content": "You are a careful assistant who looks at pictures. " * 8}


def ask(engine: Engine, messages: list[dict[str, Any]], images: list[np.ndarray],
        use_cache: bool = True) -> Any:
    info = engine.vision
    assert info is not None
    tokens, starts = engine.render_chat_with_offsets(messages)
    pairs = [(image_digest(px, info.settings_key), px) for px in images]
    tokens, starts, placed = expand_placeholders(tokens, starts, info, pairs)
    req = GenerationRequest(prompt_tokens=tuple(tokens), message_starts=starts, images=placed,
                            use_cache=use_cache, sampling=SamplingParams(max_tokens=8))
    return engine.submit(req).result()


def run(kind: str, repeat: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_vlm(Path(tmp) / kind, **SIZES[kind])
        cc = CacheConfig(block_size=16, ram_budget_bytes=512 << 20)
        ec = EngineConfig(prefill_chunk_tokens=256)
        eng = Engine.load(path, ec, cc, cache=build_cache(cc), vision_cache=VisionCache(64 << 20))
        ref = Engine.load(path, ec, cc, cache=None)
        times: dict[str, list[float]] = {k: [] for k in ("turn1", "turn2", "other_text",
                                                        "turn2_nocache")}
        calls: dict[str, list[int]] = {k: [] for k in times}
        rng = np.random.default_rng(0)
        n_prompt = 0
        try:
            for _ in range(repeat + 1):  # the first round warms up
                px = rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)
                t1 = [SYSTEM, {"role": "user", "content": "What is in this photo? <image>"}]
                c0 = eng.vision_encoder.tower_calls  # type: ignore[union-attr]
                r1 = ask(eng, t1, [px])
                c1 = eng.vision_encoder.tower_calls  # type: ignore[union-attr]
                t2 = [*t1, {"role": "assistant", "content": r1.text},
                      {"role": "user", "content": "Describe the colours."}]
                r2 = ask(eng, t2, [px])
                c2 = eng.vision_encoder.tower_calls  # type: ignore[union-attr]
                other = [SYSTEM, {"role": "user", "content": "Different words, same photo <image>"}]
                r3 = ask(eng, other, [px])
                c3 = eng.vision_encoder.tower_calls  # type: ignore[union-attr]
                r4 = ask(ref, t2, [px], use_cache=False)
                if r4.tokens != r2.tokens:
                    raise RuntimeError("cached turn 2 differs from the uncached one")
                n_prompt = r2.usage.prompt_tokens
                for key, r, c in (("turn1", r1, c1 - c0), ("turn2", r2, c2 - c1),
                                  ("other_text", r3, c3 - c2), ("turn2_nocache", r4, 1)):
                    times[key].append(r.ttft_s)
                    calls[key].append(c)
        finally:
            eng.close()
            ref.close()
        med = {k: statistics.median(v[1:]) for k, v in times.items()}
        return {"kind": kind, "tokens_per_image": eng.vision.tokens_per_image,  # type: ignore[union-attr]
                "turn2_prompt": n_prompt, "ttft": med,
                "calls": {k: v[-1] for k, v in calls.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print(f"machine: {platform.machine()} {platform.system()}, python {platform.python_version()}")
    print("| model | image tokens | turn-2 prompt | turn 1 TTFT | turn 2 TTFT (vision calls) "
          "| same image, other text (vision calls) | turn 2 without cache | turn2 / turn1 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for kind in SIZES:
        r = run(kind, args.repeat)
        t, c = r["ttft"], r["calls"]
        print(f"| {kind} | {r['tokens_per_image']} | {r['turn2_prompt']} | "
              f"{t['turn1'] * 1000:.1f} ms | {t['turn2'] * 1000:.1f} ms ({c['turn2']}) | "
              f"{t['other_text'] * 1000:.1f} ms ({c['other_text']}) | "
              f"{t['turn2_nocache'] * 1000:.1f} ms | {t['turn2'] / t['turn1']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
