"""The MLX ``PayloadAdapter``: block payloads <-> one byte buffer, for the lower tiers.

The cache core keeps payloads opaque and asks the adapter only for sizes (from
metadata, never evaluating) and for a block's bytes when it goes to a lower tier
(``codec`` puts them behind the block's header, block format 3).

A payload is a ``BlockPayload`` (``blockbuf``: one ``uint8`` buffer per block): its
buffer travels as it is, with its layout string; ``from_buffer`` makes it one
``mx.array`` again (the one copy out of the decoded bytes). A plain
``dict[str, mx.array]`` (tests, tools) is packed into one buffer first.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from .blockbuf import BlockPayload, pack_named, rows_from_host
from .blocklayout import parse_layout

logger = logging.getLogger(__name__)


class MLXPayloadAdapter:
    """Payload adapter for ``BlockPayload`` (and plain ``dict[str, mx.array]``) payloads."""

    name = "mlx"

    def nbytes(self, payload: Mapping[str, Any]) -> int:
        """Bytes from shape x dtype metadata (``mx.array.nbytes`` does not evaluate)."""
        if isinstance(payload, BlockPayload):
            return payload.nbytes
        return sum(int(a.nbytes) for a in payload.values())

    def num_arrays(self, payload: Mapping[str, Any]) -> int:
        """Arrays the payload holds in memory (one per block for a ``BlockPayload``)."""
        return 1 if isinstance(payload, BlockPayload) else len(payload)

    def to_buffer(self, payload: Mapping[str, Any]) -> tuple[np.ndarray, str]:
        """The block's buffer as a read-only numpy view (no copy) and its layout text;
        a plain dict of ``mx.array`` is packed into one buffer first."""
        if not isinstance(payload, BlockPayload):
            if not all(isinstance(a, mx.array) for a in payload.values()):
                raise ValueError("a payload is a BlockPayload or a dict of mx.array")
            payload = pack_named(payload)
        view = np.asarray(payload.buffer)  # the buffer protocol: no copy
        view.flags.writeable = False
        return view, payload.layout.text

    def from_buffer(self, buffer: np.ndarray, layout: str) -> BlockPayload:
        """Inverse of ``to_buffer``: one evaluated ``mx.array`` (a copy of ``buffer``).
        Raises ValueError for a buffer that does not match its layout."""
        parsed = parse_layout(layout)
        if buffer.dtype != np.uint8 or buffer.ndim != 1 or buffer.size != parsed.nbytes:
            raise ValueError(f"block buffer is {buffer.dtype}{buffer.shape}, its layout needs "
                             f"uint8 ({parsed.nbytes},)")
        out = mx.array(buffer)
        mx.eval(out)
        return BlockPayload(out, parsed)


    def from_buffers(self, items: Sequence[tuple[np.ndarray, str]]) -> list[BlockPayload]:
        """``from_buffer`` of a run of blocks: consecutive blocks of one layout become
        rows of one slab (one array made from host memory for them, restored with one
        strided copy per layer array). Raises ValueError for any buffer that does not
        match its layout."""
        out: list[BlockPayload] = []
        i = 0
        while i < len(items):
            j = i + 1
            while j < len(items) and items[j][1] == items[i][1]:
                j += 1
            parsed = parse_layout(items[i][1])
            group = [buf for buf, _ in items[i:j]]
            for buf in group:
                if buf.dtype != np.uint8 or buf.ndim != 1 or buf.size != parsed.nbytes:
                    raise ValueError(f"block buffer is {buf.dtype}{buf.shape}, its layout "
                                     f"needs uint8 ({parsed.nbytes},)")
            if len(group) == 1:
                out.append(self.from_buffer(group[0], items[i][1]))
            else:
                out.extend(rows_from_host(group, parsed))
            i = j
        return out


def ram_census(cache: Any, quant: Any = None) -> dict[str, Any]:
    """What the RAM tier of ``cache`` holds, by payload: blocks, tokens, arrays (Metal
    buffers on Apple GPUs), bytes, quantized blocks; per cached token. ``quant`` (a
    ``KVQuant`` or None) is reported as the store's spec. A snapshot walk over the
    pool's blocks (O(blocks); for stats, not for a hot path)."""
    pool = getattr(cache, "pool", None)
    blocks = pool.blocks() if pool is not None else []
    arrays = tokens = nbytes = quantized = 0
    slabs: set[int] = set()
    for b in blocks:
        payload = b.payload
        tokens += b.num_tokens
        nbytes += int(b.nbytes)
        if isinstance(payload, BlockPayload):
            if payload.slab is None:
                arrays += 1
            elif id(payload.slab) not in slabs:  # a slab's rows share its one buffer
                slabs.add(id(payload.slab))
                arrays += 1
            quantized += payload.layout.quantized
        elif isinstance(payload, Mapping):
            arrays += len(payload)
    return {
        "kv_quantization": getattr(quant, "spec", None),
        "ram_blocks": len(blocks),
        "ram_tokens": tokens,
        "ram_arrays": arrays,
        "ram_quantized_blocks": quantized,
        "arrays_per_cached_token": arrays / tokens if tokens else 0.0,
        "bytes_per_cached_token": nbytes / tokens if tokens else 0.0,
    }
