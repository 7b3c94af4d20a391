"""Crash-test child: generate continuously through an Engine with the SSD tier
(write-through) until killed.

usage: crash_generator.py MODEL_DIR CACHE_DIR SEED

Prints "ready" once the first request's blocks are on disk,
then keeps generating on fresh prompts derived from SEED.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from crash_prompts import CACHE_CONFIG, ENGINE_CONFIG, prompt_for  # noqa: E402

from promptcache.cli.wiring import build_cache  # noqa: E402
from promptcache.config import SSDConfig  # noqa: E402
from promptcache.engine.engine import Engine  # noqa: E402


def main() -> None:
    model, root, seed = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    ssd = SSDConfig(path=root, policy="write_through")
    with Engine.load(model, ENGINE_CONFIG, CACHE_CONFIG,
                     cache=build_cache(CACHE_CONFIG, ssd)) as engine:
        i = 0
        while True:
            engine.generate(prompt_for(seed, i), max_tokens=6)
            if i == 0:
                engine.cache.flush()  # prompt 0 is now fully on disk (nothing waits for room)
                print("ready", flush=True)
            i += 1


if __name__ == "__main__":
    main()
