"""Kill-9 test child: fill a cache's RAM with blocks its SSD tier lacks, then close
(the shutdown's persist: batched writes). The parent kills it during the close.

usage: shutdown_child.py ROOT N_BLOCKS
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from shutdown_blocks import NS, payload_for, prompt  # noqa: E402

from promptcache.cache import PromptCache  # noqa: E402
from promptcache.config import CacheConfig, SSDConfig  # noqa: E402
from promptcache.tiers.ssd import SSDTier  # noqa: E402


def main() -> None:
    root, n = Path(sys.argv[1]), int(sys.argv[2])
    ssd = SSDTier(SSDConfig(path=root, fsync=True))
    cache = PromptCache(CacheConfig(block_size=NS.block_size, ram_budget_bytes=1 << 30),
                        lower=[ssd])
    assert cache.store(NS, prompt(n), n * NS.block_size, payload_for) == n
    print("closing", flush=True)
    cache.close()
    print("closed", flush=True)


if __name__ == "__main__":
    main()
