"""SSD tier restore throughput (a script, not a test).

Stores a ~200 MB prefix as 64-token float32 KV blocks (SmolLM2-135M shape:
30 layers x 3 KV heads x head_dim 64, k and v = 46 KB per token) through
``SSDTier.put`` (block format 3: one buffer per block behind its header; appended
to segment files, ``--segment-mb``, 0: one file per block), then restores it as the
cache restores a run, through ``SSDTier.get_many`` (size + xxh3-128 verified) +
``codec.decode`` (a zero-copy view of the buffer) and compares with

* a raw sequential read of the same number of bytes from one file on the same
  disk (8 MB reads), and
* recomputing the prefix by prefill at ``--prefill-tok-s`` tokens/s (default 160:
  a rough figure for a 135M model on this CPU with OpenBLAS; an assumption, not
  measured here).

Page cache: ``/proc/sys/vm/drop_caches`` needs privileges we may not have, so
every file is fsynced and then dropped with ``posix_fadvise(DONTNEED)`` before
each cold read (the script says which method it used). Warm (page-cached)
numbers are printed too.

usage: python bench/bench_ssd.py [--mb 200] [--repeat 3] [--dir DIR] [--segment-mb 256]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from page_cache import drop_cache

from promptcache.cache.types import NumpyAdapter
from promptcache.codec import decode, encode
from promptcache.config import SSDConfig
from promptcache.meta import Namespace
from promptcache.tiers.ssd import READ_AHEAD_BLOCKS, SSDTier
from promptcache.tiers.ssd_files import INDEX_NAME

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 64
BYTES_PER_TOKEN = LAYERS * 2 * KV_HEADS * HEAD_DIM * 4


def block_arrays(rng: np.random.Generator) -> dict[str, np.ndarray]:
    out = {}
    for layer in range(LAYERS):
        for kind in ("k", "v"):
            out[f"{layer}.{kind}"] = rng.standard_normal((1, KV_HEADS, BLOCK, HEAD_DIM), dtype=np.float32)
    return out


def block_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and p.suffix in (".safetensors", ".seg")
            and "quarantine" not in p.parts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=200.0, help="prefix size in MB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="scratch folder (default: system temp)")
    ap.add_argument("--prefill-tok-s", type=float, default=160.0)
    ap.add_argument("--read-ahead", type=int, default=READ_AHEAD_BLOCKS,
                    help="blocks read and verified ahead by SSDTier.get (0: off)")
    ap.add_argument("--segment-mb", type=int, default=256,
                    help="segment file size in MB (0: one file per block)")
    args = ap.parse_args()

    n_blocks = max(1, round(args.mb * 1e6 / (BYTES_PER_TOKEN * BLOCK)))
    n_tokens = n_blocks * BLOCK
    work = Path(tempfile.mkdtemp(prefix="bench-ssd-", dir=args.dir))
    try:
        ns = Namespace("bench-model", block_size=BLOCK)
        tier = SSDTier(SSDConfig(path=work / "ssd", queue_size=8, fsync=True,
                                 segment_bytes=args.segment_mb << 20),
                      read_ahead_blocks=args.read_ahead)
        rng = np.random.default_rng(0)
        tokens = list(range(n_tokens))
        from promptcache.hashing import hash_block
        from promptcache.meta import BlockMeta

        metas = []
        adapter = NumpyAdapter()
        parent = ns.root
        t0 = time.perf_counter()
        total = 0
        for b in range(n_blocks):
            toks = tuple(tokens[b * BLOCK : (b + 1) * BLOCK])
            h = hash_block(parent, toks)
            meta = BlockMeta(h, parent, toks, b * BLOCK, nbytes=BYTES_PER_TOKEN * BLOCK,
                             namespace_key=ns.key, tenant=ns.tenant)
            buffer, layout = adapter.to_buffer(block_arrays(rng))
            data = encode(meta, (), layout, buffer)
            total += len(data)
            while not tier.put(meta, data):
                time.sleep(0.001)
            metas.append(meta)
            parent = h
        tier.flush()
        write_s = time.perf_counter() - t0
        files = block_files(work / "ssd")

        raw = work / "raw.bin"
        chunk = os.urandom(8 << 20)
        with open(raw, "wb") as f:
            left = total
            while left > 0:
                f.write(chunk[: min(left, len(chunk))])
                left -= len(chunk)
            f.flush()
            os.fsync(f.fileno())

        def restore() -> float:
            t = time.perf_counter()
            n = 0
            for got in tier.get_many([m.block_hash for m in metas]):
                assert isinstance(got, tuple)
                n += decode(got[0]).buffer.size
            return time.perf_counter() - t

        def files_decode() -> float:  # diagnostic: the same files, no index, no checksum
            t = time.perf_counter()
            for p in files:
                with open(p, "rb") as f:
                    data = f.read()
                    if p.suffix == ".safetensors":
                        decode(data)
            return time.perf_counter() - t

        def raw_read() -> float:
            t = time.perf_counter()
            with open(raw, "rb", buffering=0) as f:
                while f.read(8 << 20):
                    pass
            return time.perf_counter() - t

        cold_r, cold_raw, warm_r, warm_raw, cold_nock = [], [], [], [], []
        method = ""
        for _ in range(args.repeat):
            method = drop_cache([*files, work / "ssd" / INDEX_NAME])
            cold_r.append(restore())
            warm_r.append(restore())  # the files are page-cached by the cold restore
            method = drop_cache([raw])  # drop_caches drops everything, block files too
            cold_raw.append(raw_read())
            warm_raw.append(raw_read())
            drop_cache(files)
            cold_nock.append(files_decode())
        tier.close()

        mb = total / 1e6
        r, rr = statistics.median(cold_r), statistics.median(cold_raw)
        wr, wrr = statistics.median(warm_r), statistics.median(warm_raw)
        recompute_s = n_tokens / args.prefill_tok_s
        print(f"machine: {platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}")
        print(f"prefix: {n_tokens} tokens = {n_blocks} blocks x {BLOCK} tokens, {mb:.1f} MB on disk "
              f"({BYTES_PER_TOKEN} B/token float32)")
        print(f"write (put + flush, fsync): {write_s:.2f} s = {mb / write_s:.0f} MB/s")
        print(f"page cache dropped with: {method}; median of {args.repeat}")
        layout = f"segments of {args.segment_mb} MB" if args.segment_mb else "one file per block"
        print(f"layout: {layout} ({len(files)} files)")
        print(f"cold restore (get_many + checksum + decode): {r:.3f} s = {mb / r:.0f} MB/s")
        print(f"cold raw sequential read:               {rr:.3f} s = {mb / rr:.0f} MB/s")
        print(f"cold ratio restore/raw:                 {rr / r:.2f}  (target >= 1.0, issue 41)")
        ratios = sorted(b / a for a, b in zip(cold_r, cold_raw, strict=True))
        print(f"  per run: restore best {min(cold_r):.3f} s, raw best {min(cold_raw):.3f} s; "
              f"ratio per run min {ratios[0]:.2f} / median {statistics.median(ratios):.2f} / max {ratios[-1]:.2f}")
        nock = statistics.median(cold_nock)
        print(f"cold read + decode of the block files without checksum (diagnostic): {nock:.3f} s = "
              f"{mb / nock:.0f} MB/s, ratio {rr / nock:.2f}")
        print(f"warm restore (best {min(warm_r):.3f} s): {wr:.3f} s = {mb / wr:.0f} MB/s; warm raw: {wrr:.3f} s = {mb / wrr:.0f} MB/s; "
              f"ratio {wrr / wr:.2f}")
        print(f"recompute at {args.prefill_tok_s:.0f} tok/s (assumed): {recompute_s:.1f} s -> "
              f"restore is {recompute_s / r:.0f}x faster (target >= 10x)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
