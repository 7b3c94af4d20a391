"""Clean shutdown and restart of the SSD tier, against the disk (a script, not a test).

Fills a ``PromptCache`` RAM tier (numpy payload adapter, write_back policy) with
``--gb`` GB of KV blocks that its SSD tier (fsync on) does not hold: by default the
Qwen3-30B-A3B shape, 98,304 bytes of KV per token (48 layers x 4 KV heads x 128 x
k+v, 2-byte floats), 64-token blocks (6.3 MB each). Then, in one run and one folder:

* **shutdown**: ``PromptCache.close()`` (persist every RAM block the SSD lacks, then
  close the tier) timed, beside ``dd if=/dev/zero bs=16M conv=fsync`` and
  ``oflag=direct`` of the same bytes in the same folder (ratio = shutdown / dd);
* **restart after the clean shutdown**: ``SSDTier(...)`` over the folder (index
  open + startup reconcile) timed, per GB indexed; every block is then read
  (``get``: size + xxh3 verified) and compared with what was stored;
* **restart after kill -9**: the same fill and close in a child process, killed with
  SIGKILL ``--kill-at`` (fraction of the clean shutdown's time) after its close
  began; meanwhile this process polls the index read-only and records every block
  whose row was committed (acknowledged). The restart is timed, and every
  acknowledged block must be found and valid, every block found must be valid.

Each block's payload is the same arrays (the data is not what is measured; the
hashes, files and rows are each block's own).

usage: python bench/bench_shutdown.py [--gb 1] [--bytes-per-token 98304]
       [--block-tokens 64] [--dir DIR] [--kill-at 0.5]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from promptcache.cache import PromptCache
from promptcache.cache.types import NumpyAdapter
from promptcache.codec import decode
from promptcache.config import CacheConfig, SSDConfig
from promptcache.meta import Namespace
from promptcache.tiers.ssd import SSDTier
from promptcache.tiers.ssd_files import INDEX_NAME

KV_HEADS, HEAD_DIM, ITEM = 4, 128, 2
NS_NAME = "bench-shutdown"


class Shape:
    def __init__(self, bytes_per_token: int, block_tokens: int, gb: float) -> None:
        per_layer = 2 * KV_HEADS * HEAD_DIM * ITEM
        self.layers = max(1, bytes_per_token // per_layer)
        self.bytes_per_token = self.layers * per_layer
        self.block_tokens = block_tokens
        self.block_bytes = self.bytes_per_token * block_tokens
        self.n_blocks = max(1, round(gb * 1e9 / self.block_bytes))
        rng = np.random.default_rng(0)
        self.base = [rng.standard_normal((1, KV_HEADS, block_tokens, HEAD_DIM)).astype(np.float16)
                     for _ in range(self.layers)]

    def payload_for(self, start: int, end: int, snapshot: bool) -> dict[str, np.ndarray]:
        n = end - start
        out = {}
        for i, a in enumerate(self.base):
            out[f"{i}.k"] = a[:, :, :n]
            out[f"{i}.v"] = a[:, :, :n]
        return out

    def expected_buffer(self) -> bytes:
        buffer, _ = NumpyAdapter().to_buffer(self.payload_for(0, self.block_tokens, False))
        return bytes(buffer)

    def tokens(self) -> list[int]:
        return list(range(1000, 1000 + self.n_blocks * self.block_tokens))


def fill(root: Path, shape: Shape) -> tuple[PromptCache, SSDTier]:
    ns = Namespace(NS_NAME, block_size=shape.block_tokens)
    ssd = SSDTier(SSDConfig(path=root, budget_bytes=4 * shape.n_blocks * shape.block_bytes,
                            fsync=True))
    budget = int(shape.n_blocks * shape.block_bytes * 1.2) + (64 << 20)
    cache = PromptCache(CacheConfig(block_size=shape.block_tokens, ram_budget_bytes=budget),
                        NumpyAdapter(), lower=[ssd])
    toks = shape.tokens()
    created = cache.store(ns, toks, len(toks), shape.payload_for)
    assert created == shape.n_blocks, (created, shape.n_blocks)
    assert ssd.stats()["blocks_on_disk"] == 0
    return cache, ssd


def dd(path: Path, nbytes: int, flag: str) -> float:
    count = -(-nbytes // (16 << 20))
    t = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={count}", flag],
                   check=True, capture_output=True)
    s = time.perf_counter() - t
    path.unlink()
    return s


def restart(root: Path) -> tuple[float, SSDTier]:
    t = time.perf_counter()
    ssd = SSDTier(SSDConfig(path=root, budget_bytes=1 << 40, fsync=True))
    return time.perf_counter() - t, ssd


def verify(ssd: SSDTier, expected: bytes) -> tuple[int, int, set[bytes]]:
    """(blocks found, bytes, hashes) with every found block read, verified, compared."""
    found: set[bytes] = set()
    nbytes = 0
    for row in ssd.rows():
        data = ssd.get(row.meta.block_hash)
        assert data is not None, row.meta.block_hash.hex()
        assert bytes(decode(data).buffer) == expected, "a block's payload differs"
        found.add(bytes(row.meta.block_hash))
        nbytes += row.file_bytes
    return len(found), nbytes, found


def child(root: Path, args: argparse.Namespace) -> None:
    shape = Shape(args.bytes_per_token, args.block_tokens, args.gb)
    cache, _ = fill(root, shape)
    print("closing", flush=True)
    cache.close()
    print("closed", flush=True)


def committed(root: Path) -> set[bytes]:
    try:
        db = sqlite3.connect(f"file:{root / INDEX_NAME}?mode=ro", uri=True, timeout=5)
        try:
            return {bytes(r[0]) for r in db.execute("SELECT hash FROM blocks")}
        finally:
            db.close()
    except sqlite3.Error:
        return set()


def killed_run(root: Path, args: argparse.Namespace, kill_after: float) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", str(root), "--gb", str(args.gb),
           "--bytes-per-token", str(args.bytes_per_token),
           "--block-tokens", str(args.block_tokens)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "closing"
    t0 = time.perf_counter()
    acked: set[bytes] = set()
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            acked.update(committed(root))
            time.sleep(0.005)

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(kill_after)
    stop.set()
    poller.join()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = time.perf_counter() - t0
    temps = sum(1 for p in root.rglob(".tmp-*"))
    secs, ssd = restart(root)
    report = ssd.startup_report
    n, nbytes, found = verify(ssd, Shape(args.bytes_per_token, args.block_tokens, 0).expected_buffer())
    ssd.close()
    lost = acked - found
    return {"killed_after_s": killed_at, "acknowledged": len(acked), "found": n,
            "lost": len(lost), "bytes": nbytes, "restart_s": secs, "temp_files": temps,
            "repair": report.to_dict() if report is not None else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--bytes-per-token", type=int, default=98_304)
    ap.add_argument("--block-tokens", type=int, default=64)
    ap.add_argument("--dir", type=Path, default=None, help="scratch folder (default: system temp)")
    ap.add_argument("--kill-at", type=float, default=0.5,
                    help="kill -9 the child this fraction of the clean shutdown's time "
                         "after its close began")
    ap.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.child, args)
        return

    shape = Shape(args.bytes_per_token, args.block_tokens, args.gb)
    work = Path(tempfile.mkdtemp(prefix="bench-shutdown-", dir=args.dir))
    try:
        print(f"machine: {platform.machine()} {os.cpu_count()} cpus, python "
              f"{platform.python_version()}, folder {work}")
        print(f"shape: {shape.layers} layers, {shape.bytes_per_token} B/token, "
              f"{shape.block_tokens}-token blocks of {shape.block_bytes / 1e6:.2f} MB, "
              f"{shape.n_blocks} blocks")
        root = work / "ssd"
        t = time.perf_counter()
        cache, ssd = fill(root, shape)
        print(f"fill (RAM): {time.perf_counter() - t:.2f} s")
        t = time.perf_counter()
        cache.close()
        shut = time.perf_counter() - t
        rep = cache.last_persist
        assert rep is not None
        written = ssd.catalog.bytes_written
        gb = written / 1e9
        dd_fsync = dd(work / "dd.bin", written, "conv=fsync")
        dd_direct = dd(work / "dd.bin", written, "oflag=direct")
        print(f"shutdown: {rep.written} blocks ({rep.failed} failed), {gb:.3f} GB in "
              f"{shut:.2f} s = {gb / shut:.3f} GB/s (persist {rep.seconds:.2f} s)")
        print(f"dd conv=fsync: {dd_fsync:.2f} s = {gb / dd_fsync:.3f} GB/s; ratio "
              f"shutdown / dd {shut / dd_fsync:.2f}")
        print(f"dd oflag=direct: {dd_direct:.2f} s = {gb / dd_direct:.3f} GB/s; ratio "
              f"shutdown / dd {shut / dd_direct:.2f}")

        secs, ssd = restart(root)
        t = time.perf_counter()
        n, nbytes, _ = verify(ssd, shape.expected_buffer())
        read_s = time.perf_counter() - t
        ssd.close()
        print(f"restart after clean shutdown: {secs * 1000:.1f} ms for {n} blocks / "
              f"{nbytes / 1e9:.3f} GB indexed = {secs / (nbytes / 1e9) * 1000:.1f} ms per GB; "
              f"found {n} of {shape.n_blocks} (all read + verified in {read_s:.2f} s)")
        assert n == shape.n_blocks == rep.written

        shutil.rmtree(root)
        k = killed_run(work / "ssd-killed", args, args.kill_at * shut)
        per_gb = k["restart_s"] / max(k["bytes"] / 1e9, 1e-9) * 1000
        print(f"kill -9 {k['killed_after_s']:.2f} s into the shutdown: {k['acknowledged']} "
              f"blocks acknowledged (committed rows seen), {k['found']} found valid after "
              f"the restart, {k['lost']} lost; {k['temp_files']} temp files left; restart "
              f"{k['restart_s'] * 1000:.1f} ms for {k['bytes'] / 1e9:.3f} GB = {per_gb:.1f} ms "
              f"per GB; repair {k['repair']}")
        assert k["lost"] == 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
