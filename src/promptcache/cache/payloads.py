"""A RAM block's payload as the bytes a lower tier stores (block format 3: ``codec``),
and stored bytes back into a RAM block (promotion, import)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import codec
from ..blocks.pool import SNAPSHOT, TRUNCATABLE, Block, BlockPool
from ..hashing import BlockHash
from ..meta import BlockMeta, Namespace
from ..tiers.base import LazyPayload
from .types import DecodeFn, EncodeFn, NumpyAdapter, PayloadAdapter


class Payloads:
    """The payload adapter (default ``NumpyAdapter``) and the codec (``encode`` / ``decode``)."""

    def __init__(self, adapter: PayloadAdapter | None = None, encode: EncodeFn | None = None,
                 decode: DecodeFn | None = None) -> None:
        self.adapter: PayloadAdapter = adapter if adapter is not None else NumpyAdapter()
        self._encode = encode
        self._decode = decode

    def source(self, block: Block) -> LazyPayload:
        """The block's payload as a ``PayloadSource``, encoded (self-describing header, so
        a lost index can be rebuilt) once, by the first tier writer that needs it, off the
        request path; the sessions are taken now, under the cache lock."""
        adapter, payload, bm = self.adapter, block.payload, block.meta()
        sessions: Sequence[str] = tuple(sorted(block.sessions))

        def make() -> bytes:
            buffer, layout = adapter.to_buffer(payload)
            return (self._encode or codec.encode)(bm, sessions, layout, buffer)

        return LazyPayload(make, block.nbytes)

    def load(self, data: bytes, expect: BlockHash) -> tuple[Any, int] | None:
        """``(payload, nbytes)`` of stored bytes; None when they belong to another block
        than ``expect``. Raises CorruptBlockError / UnsupportedFormatError / ValueError."""
        dec = (self._decode or codec.decode)(data)
        if dec.desc.meta.block_hash != expect:
            return None
        payload = self.adapter.from_buffer(dec.buffer, dec.desc.layout)
        return payload, self.adapter.nbytes(payload)


    def load_many(self, items: Sequence[tuple[bytes, BlockHash]]
                  ) -> list[tuple[Any, int] | Exception | None]:
        """``load`` of a run of blocks, each result in place (a block's exception is
        returned); with ``from_buffers`` the run's payloads are made in one call."""
        out: list[tuple[Any, int] | Exception | None] = [None] * len(items)
        todo: list[tuple[int, np.ndarray, str]] = []
        for i, (data, expect) in enumerate(items):
            try:
                dec = (self._decode or codec.decode)(data)
            except Exception as e:
                out[i] = e
                continue
            if dec.desc.meta.block_hash == expect:
                todo.append((i, dec.buffer, dec.desc.layout))
        many = getattr(self.adapter, "from_buffers", None)
        if many is not None and len(todo) > 1:
            try:
                made = many([(buf, layout) for _, buf, layout in todo])
            except Exception:  # one bad buffer: each on its own, each its own result
                made = None
            if made is not None:
                for (i, _, _), payload in zip(todo, made, strict=True):
                    out[i] = (payload, self.adapter.nbytes(payload))
                return out
        for i, buf, layout in todo:
            try:
                payload = self.adapter.from_buffer(buf, layout)
                out[i] = (payload, self.adapter.nbytes(payload))
            except Exception as e:
                out[i] = e
        return out


def allocate_stored(pool: BlockPool, meta: BlockMeta, ns: Namespace, payload: Any,
                    nbytes: int, now: float) -> Block:
    """A RAM block for a stored block (promoted or imported): its metadata, its payload."""
    flags = (TRUNCATABLE if meta.truncatable else 0) | (SNAPSHOT if meta.snapshot else 0)
    return pool.allocate(
        block_hash=meta.block_hash, parent_hash=meta.parent_hash,
        tokens=np.asarray(meta.token_ids, dtype="<u4").tobytes(), start=meta.start,
        extra_keys=tuple(meta.extra_keys), flags=flags, ns=ns, payload=payload,
        nbytes=nbytes, now=now)
