"""The MLX ``PayloadAdapter``: block payloads <-> one byte buffer (and its layout) for the lower
tiers.
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
    copies_buffers = True  # from_buffer(s) copy: a mapped segment's view is read in place

    def nbytes(self, payload: Mapping[str, Any]) -> int:
        """Bytes from shape x dtype metadata (``mx.array.nbytes`` does not evaluate)."""
        if isinstance(payload, BlockPayload):
            return payload.nbytes
        return sum(int(a.nbytes) for a in payload.values())

    def num_arrays(self, payload: Mapping[str, Any]) -> int:
        """Arrays the payload holds in memory (one per block for a ``BlockPayload``)."""
        return 1 if isinstance(payload, BlockPayload) else len(payload)

    def to_buffer(self, payload: Mapping[str, Any]) -> tuple[np.ndarray, str]:
        """The block's buffer as a read-only numpy view (no copy) and its layout text."""
        if not isinstance(payload, BlockPayload):
            if not all(isinstance(a, mx.array) for a in payload.values()):
                raise ValueError("a payload is a BlockPayload or a dict of mx.array")
            payload = pack_named(payload)
        view = np.asarray(payload.buffer)  # the buffer protocol: no copy
        view.flags.writeable = False
        return view, payload.layout.text

    def from_buffer(self, buffer: np.ndarray, layout: str) -> BlockPayload:
        """One evaluated ``mx.array`` (a copy of ``buffer``); ValueError if unlike its layout."""
        parsed = parse_layout(layout)
        if buffer.dtype != np.uint8 or buffer.ndim != 1 or buffer.size != parsed.nbytes:
            raise ValueError(f"block buffer is {buffer.dtype}{buffer.shape}, its layout needs "
                             f"uint8 ({parsed.nbytes},)")
        out = mx.array(buffer)
        mx.eval(out)
        return BlockPayload(out, parsed)


    def from_buffers(self, items: Sequence[tuple[np.ndarray, str]]) -> list[BlockPayload]:
        """``from_buffer`` of a run (rows of one slab); ValueError on a mismatch."""
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
    """What ``cache``'s RAM tier holds by payload (blocks, tokens, arrays, bytes), for stats."""
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
