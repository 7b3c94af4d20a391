"""Blocks for the Redis tier tests: namespaces, chains of BlockMeta and payloads."""

from __future__ import annotations

import numpy as np

from promptcache import codec
from promptcache.cache.types import NumpyAdapter
from promptcache.hashing import BlockHash, hash_block
from promptcache.meta import BlockMeta, Namespace

BS = 4


def ns(tenant: str = "default", model: str = "model-a") -> Namespace:
    return Namespace(model, BS, "float32", tenant)


def chain(space: Namespace, tokens: list[int], *, start_parent: BlockHash | None = None
          ) -> list[BlockMeta]:
    """BlockMeta of the blocks of ``tokens`` (the last one may be partial)."""
    out: list[BlockMeta] = []
    parent = start_parent or space.root
    for s in range(0, len(tokens), BS):
        t = tuple(tokens[s:s + BS])
        h = hash_block(parent, t, ())
        out.append(BlockMeta(block_hash=h, parent_hash=parent, token_ids=t, start=s,
                             nbytes=len(t) * 16, namespace_key=space.key, tenant=space.tenant))
        parent = h
    return out


def payload(meta: BlockMeta) -> bytes:
    arr = np.arange(len(meta.token_ids) * 4, dtype=np.float32) + meta.start
    return codec.encode(meta, (), *NumpyAdapter().to_buffer({"0.k": arr})[::-1])


class Source:
    """A payload that encodes itself on the writer thread (the PayloadSource shape)."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self.nbytes = len(data)
        self.calls = 0

    def encode(self) -> bytes:
        self.calls += 1
        return self._data
