"""kill -9 a process that stores blocks continuously, 50 times; after each kill,
reconcile leaves index and files consistent and every committed block reads back
with a valid checksum and exactly the bytes that were written."""

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from crash_writer import crash_meta, crash_payload
from ssd_helpers import make_tier, payload_for

from promptcache.codec import decode

RUNS = 50
WRITER = Path(__file__).parent / "crash_writer.py"
BUDGET = 40 * len(payload_for(0, 112))  # ~40 blocks: evictions happen during the runs


def one_run(root: Path, first: int, rng: random.Random) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(WRITER), str(root), str(first), str(BUDGET)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        if rng.random() < 0.2:
            time.sleep(rng.uniform(0.0, 0.3))  # may hit import or the child's own reconcile
        else:
            assert proc.stdout is not None
            assert proc.stdout.readline() == b"ready\n"
            time.sleep(rng.uniform(0.02, 0.3))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)


def verify(root: Path) -> int:
    tier = make_tier(root, budget_bytes=BUDGET)
    try:
        assert tier.check(fix=False).problems == 0
        rows = tier.rows()
        total = 0
        for row in rows:
            i = row.meta.token_ids[0]
            assert row.meta == crash_meta(i)
            data = tier.get(row.meta.block_hash)
            assert data in (crash_payload(i, 0), crash_payload(i, 1)), f"block {i} has wrong bytes"
            decode(data)
            total += len(data)
        s = tier.stats()
        assert (s["blocks_on_disk"], s["bytes_on_disk"], s["corrupt"]) == (len(rows), total, 0)
        files = [p for p in root.rglob("*.safetensors") if "quarantine" not in p.parts]
        assert len(files) == len(rows)
        assert list(root.rglob(".tmp-*")) == []
        return len(rows)
    finally:
        tier.close()


def test_sigkill_50_times(tmp_path):
    rng = random.Random(1234)
    root = tmp_path / "cache"
    seen = 0
    for run in range(RUNS):
        one_run(root, run * 10_000, rng)
        seen += verify(root)
    assert seen > 0  # the runs did commit blocks
