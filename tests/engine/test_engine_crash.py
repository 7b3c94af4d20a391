"""kill -9 an engine that generates through the SSD tier (write-through), at random
moments; after each kill the folder reconciles clean, and a fresh engine's output
from the surviving blocks equals a full prefill."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from crash_prompts import CACHE_CONFIG, ENGINE_CONFIG, prompt_for

from promptcache.cli.wiring import build_cache
from promptcache.config import SSDConfig
from promptcache.engine.engine import Engine
from promptcache.tiers.ssd import SSDTier

CHILD = Path(__file__).parent / "crash_generator.py"
RUNS = 4


def kill_at_random(model: Path, root: Path, seed: int, rng: random.Random) -> None:
    proc = subprocess.Popen([sys.executable, str(CHILD), str(model), str(root), str(seed)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"ready\n"
        time.sleep(rng.uniform(0.0, 0.5))  # mid-prefill, mid-decode or mid-write
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)


def test_kill_9_during_generation_then_restore_equals_full_prefill(tiny_llama_path, tmp_path):
    rng = random.Random(7)
    root = tmp_path / "ssd"
    for run in range(RUNS):
        kill_at_random(tiny_llama_path, root, run, rng)
        tier = SSDTier(SSDConfig(path=root))  # the startup reconcile repairs the crash
        assert tier.check(fix=False).problems == 0
        assert tier.stats()["blocks_on_disk"] > 0
        tier.close()
        with Engine.load(tiny_llama_path, ENGINE_CONFIG, CACHE_CONFIG,
                         cache=build_cache(CACHE_CONFIG, SSDConfig(path=root))) as engine:
            prompt = prompt_for(run, 0)  # finished before the kill: fully committed
            cached = engine.generate(prompt, max_tokens=6)
            full = engine.generate(prompt, max_tokens=6, use_cache=False)
            assert cached.usage.cached_tokens >= 24
            assert cached.usage.cached_by_tier.get("ssd", 0) == cached.usage.cached_tokens
            assert cached.tokens == full.tokens
            # a later prompt of the run may have been cut anywhere: still exact
            later = prompt_for(run, 3)
            assert engine.generate(later, max_tokens=6).tokens == \
                engine.generate(later, max_tokens=6, use_cache=False).tokens
