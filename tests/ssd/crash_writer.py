"""Crash-test child: store blocks continuously until killed.

usage: crash_writer.py ROOT FIRST_INDEX BUDGET_BYTES [SEGMENT_BYTES]

Block ``i`` has tokens ``(i, i, i, i)`` under the test namespace and its payload
is ``crash_payload(i, version)``: the parent recomputes both to verify what it
finds after the kill. Every 4th put rewrites an earlier block with version 1,
so rewrites (the A/B file names) are crashed too.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from ssd_helpers import NS, payload_for  # noqa: E402

from promptcache.config import SSDConfig  # noqa: E402
from promptcache.hashing import hash_block  # noqa: E402
from promptcache.meta import BlockMeta  # noqa: E402
from promptcache.tiers.ssd import SSDTier  # noqa: E402


def crash_meta(i: int) -> BlockMeta:
    toks = (i, i, i, i)
    return BlockMeta(
        hash_block(NS.root, toks), NS.root, toks, 0, namespace_key=NS.key, tenant=NS.tenant
    )


def crash_payload(i: int, version: int) -> bytes:
    return payload_for(i * 2 + version, 64 + (i % 7) * 8)


def main() -> None:
    root, first, budget = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    seg = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    tier = SSDTier(SSDConfig(path=root, budget_bytes=budget, queue_size=8, fsync=True,
                             segment_bytes=seg))
    print("ready", flush=True)
    i = first
    while True:
        if i % 4 == 3:
            j, version = i - 2, 1
        else:
            j, version = i, 0
        if tier.put(crash_meta(j), crash_payload(j, version), [f"s{j % 3}"]):
            i += 1
            if i % 64 == 0:  # deletions are crashed too
                tier.delete_session(f"s{i % 3}")
        else:
            time.sleep(0.001)


if __name__ == "__main__":
    main()
