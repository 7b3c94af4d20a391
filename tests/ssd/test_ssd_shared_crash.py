"""Two writer processes on one folder; one of them is killed with SIGKILL again and
again while the other keeps writing (and rewriting the same blocks), and the test
process opens the folder (its startup repair runs while a writer is live) and reads
every block. No corrupt block is ever served, nothing is quarantined, the folder
reconciles clean, and the byte total stays within the shared budget.

CI runs ``CYCLES`` = 8 (about 10 s). The long version, run by hand:
``PROMPTCACHE_SHARED_CRASH_CYCLES=200 .venv/bin/pytest -q tests/ssd/test_ssd_shared_crash.py``
(see BENCHMARKS.md, "Durability runs").
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from crash_writer import crash_meta, crash_payload
from ssd_helpers import make_tier, payload_for

CYCLES = int(os.environ.get("PROMPTCACHE_SHARED_CRASH_CYCLES", "8"))
WRITER = Path(__file__).parent / "crash_writer.py"
BUDGET = 40 * len(payload_for(0, 112))
MAX_BLOCK = len(payload_for(0, 112))


def start_writer(root: Path, first: int, seg: int = 0) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, str(WRITER), str(root), str(first), str(BUDGET),
                             str(seg)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"ready\n"
    return proc


def read_all(root: Path, seg: int = 0) -> tuple[int, int]:
    """Open the folder as another server would (startup repair included) and read
    every block: each one has exactly the bytes some writer wrote for it."""
    tier = make_tier(root, budget_bytes=BUDGET, segment_bytes=seg)
    try:
        served = 0
        for row in tier.rows():
            i = row.meta.token_ids[0]
            assert row.meta == crash_meta(i)
            data = tier.get(row.meta.block_hash)  # CorruptBlockError would fail the test
            if data is not None:  # (None: deleted by a live writer meanwhile)
                assert data in (crash_payload(i, 0), crash_payload(i, 1)), f"block {i}: wrong bytes"
                served += 1
        s = tier.stats()
        assert (s["corrupt"], s["quarantined"]) == (0, 0)
        assert s["bytes_on_disk"] <= BUDGET + 2 * MAX_BLOCK  # a killed writer's last commit
        return served, s["bytes_on_disk"]
    finally:
        tier.close()


@pytest.mark.parametrize("seg", [0, 1 << 20])  # one file per block; segments of 1 MB
def test_two_writers_one_killed_again_and_again(tmp_path, seg):
    rng = random.Random(99)
    root = tmp_path / "cache"
    steady = start_writer(root, 0, seg)
    served = 0
    try:
        for cycle in range(CYCLES):
            victim = start_writer(root, 0 if cycle % 2 else 5_000, seg)  # overlapping, then not
            time.sleep(rng.uniform(0.02, 0.25))
            victim.send_signal(signal.SIGKILL)
            victim.wait(timeout=30)
            n, _ = read_all(root, seg)
            served += n
        assert steady.poll() is None  # the other writer lived through it all
    finally:
        steady.send_signal(signal.SIGKILL)
        steady.wait(timeout=30)
    tier = make_tier(root, budget_bytes=BUDGET, segment_bytes=seg)  # the repair after the kill
    try:
        assert tier.check(fix=False).problems == 0
        tier.sweep()  # enforces the budget a killed writer may have left exceeded
        s = tier.stats()
        assert s["bytes_on_disk"] <= BUDGET
        assert not (root / "quarantine").exists() or list((root / "quarantine").iterdir()) == []
        for row in tier.rows():
            i = row.meta.token_ids[0]
            assert tier.get(row.meta.block_hash) in (crash_payload(i, 0), crash_payload(i, 1))
    finally:
        tier.close()
    assert served > 0
