"""Blocks of the shutdown tests (shared with their kill -9 child): block ``i`` of
``prompt(n)`` holds the float ``i`` in every element, so what a restart finds can be
checked block by block."""

from __future__ import annotations

import numpy as np

from promptcache.meta import Namespace

NS = Namespace("shutdown-model", block_size=4, tenant="alice")
WIDTH = 2048  # 2 arrays x 4 tokens x 2048 float32: 64 KiB a block


def prompt(n: int) -> list[int]:
    return list(range(5000, 5000 + n * NS.block_size))


def payload_for(start: int, end: int, snapshot: bool) -> dict[str, np.ndarray]:
    k = np.full((1, 1, end - start, WIDTH), float(start // NS.block_size), dtype=np.float32)
    return {"0.k": k, "0.v": -k}
