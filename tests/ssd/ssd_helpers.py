"""Shared helpers of the SSD tier tests: deterministic blocks and payloads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save as st_save

from promptcache.cache.types import NumpyAdapter
from promptcache.codec import encode
from promptcache.config import SSDConfig
from promptcache.hashing import BlockHash, hash_block
from promptcache.meta import BlockMeta, Namespace
from promptcache.tiers.ssd import SSDTier

NS = Namespace("test-model", block_size=4, tenant="alice")
NS_BOB = NS.with_tenant("bob")


def payload_for(i: int, n: int = 64) -> bytes:
    """A deterministic block (block format 3, ``codec``) for block number ``i``: its
    header describes a block of its own (token ``i``), not a block of ``chain``."""
    rng = np.random.default_rng(i)
    arr = rng.standard_normal((1, 2, 4, n // 8), dtype=np.float32)
    buffer, layout = NumpyAdapter().to_buffer({"0.k": arr, "0.v": arr * 2})
    root = BlockHash(bytes(32))
    meta = BlockMeta(hash_block(root, (i,)), root, (i,), 0, nbytes=2 * arr.nbytes,
                     namespace_key="payload-for", tenant="alice")
    return encode(meta, (), layout, buffer)


def legacy_payload_for(i: int, n: int = 64) -> bytes:
    """What an older cache wrote (block format 1: one safetensors tensor per array)."""
    rng = np.random.default_rng(i)
    arr = rng.standard_normal((1, 2, 4, n // 8), dtype=np.float32)
    return st_save({"0.k": arr, "0.v": arr * 2}, metadata={"block": str(i)})


def chain(ns: Namespace, n_blocks: int, first_token: int = 0) -> list[BlockMeta]:
    """Metas of ``n_blocks`` chained full blocks of ``ns`` (tokens first_token, +1, ...)."""
    out = []
    parent: BlockHash = ns.root
    for b in range(n_blocks):
        start = b * ns.block_size
        toks = tuple(range(first_token + start, first_token + start + ns.block_size))
        h = hash_block(parent, toks)
        out.append(
            BlockMeta(h, parent, toks, start, nbytes=100, namespace_key=ns.key, tenant=ns.tenant)
        )
        parent = h
    return out


def make_tier(path: Path, **kw: object) -> SSDTier:
    tier_kw = {k: kw.pop(k) for k in list(kw) if k in ("clock", "sweep_interval_s", "degraded_backoff_s", "reconcile_on_open", "read_ahead_blocks", "read_only", "disk_usage", "index_check_interval_s")}
    cfg = SSDConfig(path=path, fsync=bool(kw.pop("fsync", False)), **kw)  # type: ignore[arg-type]
    return SSDTier(cfg, **tier_kw)  # type: ignore[arg-type]


class FakeClock:
    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped (a temp file named with it
    is a dead writer's leftover; pids are reused only after wrapping around)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid
