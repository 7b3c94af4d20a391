"""The MLX ``PayloadAdapter``: block payloads <-> numpy, for the lower tiers.

The cache core keeps payloads opaque and asks the adapter only for sizes (from
metadata, never evaluating) and for a numpy form when a block goes to a lower tier
(``codec`` turns that into safetensors bytes).

A payload is a ``BlockPayload`` (``blockbuf``: one ``uint8`` buffer per block). It
travels as one array named ``"block"`` plus its layout string under the metadata key
``"layout"``; ``from_numpy`` makes it one ``mx.array`` again (the one copy out of the
decoded bytes). Older payloads (one array per tensor; numpy has no bfloat16, so such
arrays travel as ``uint16`` views with a ``dtype.<name>=bfloat16`` entry) are still
read, and packed into one buffer on the way in.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import mlx.core as mx
import numpy as np

from .blockbuf import BlockPayload, pack_named, parse_layout

logger = logging.getLogger(__name__)

DTYPE_META_PREFIX = "dtype."
LAYOUT_META = "layout"
BLOCK_ARRAY = "block"
_BF16 = "bfloat16"


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

    def to_numpy(self, payload: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """numpy arrays: a read-only view of the block's buffer (no copy), or for a
        plain dict copies of its arrays (bfloat16 as ``uint16``)."""
        return self.to_numpy_with_meta(payload)[0]

    def meta(self, payload: Mapping[str, Any]) -> dict[str, str]:
        """The metadata ``from_numpy`` needs: the layout, or which arrays are bfloat16."""
        if isinstance(payload, BlockPayload):
            return {LAYOUT_META: payload.layout.text}
        return {
            f"{DTYPE_META_PREFIX}{name}": _BF16
            for name, a in payload.items()
            if isinstance(a, mx.array) and a.dtype == mx.bfloat16
        }

    def to_numpy_with_meta(
        self, payload: Mapping[str, Any]
    ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        if isinstance(payload, BlockPayload):
            view = np.asarray(payload.buffer)  # the buffer protocol: no copy
            view.flags.writeable = False
            return {BLOCK_ARRAY: view}, {LAYOUT_META: payload.layout.text}
        arrays: dict[str, np.ndarray] = {}
        meta: dict[str, str] = {}
        for name, a in payload.items():
            if isinstance(a, np.ndarray):
                arrays[name] = a
                continue
            if not isinstance(a, mx.array):
                raise ValueError(f"payload entry {name!r} is not an array: {type(a).__name__}")
            if a.dtype == mx.bfloat16:
                arrays[name] = np.array(a.view(mx.uint16))
                meta[f"{DTYPE_META_PREFIX}{name}"] = _BF16
            else:
                arrays[name] = np.array(a)
        return arrays, meta

    def from_numpy(
        self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, str] | None = None
    ) -> BlockPayload:
        """Inverse of ``to_numpy``: one evaluated buffer. Raises ValueError for arrays
        that do not match their layout."""
        meta = meta or {}
        text = meta.get(LAYOUT_META)
        if text is not None:
            layout = parse_layout(text)
            if set(arrays) != {BLOCK_ARRAY}:
                raise ValueError(f"a block payload is one array {BLOCK_ARRAY!r}, got {sorted(arrays)}")
            arr = arrays[BLOCK_ARRAY]
            if arr.dtype != np.uint8 or arr.ndim != 1 or arr.size != layout.nbytes:
                raise ValueError(f"block buffer is {arr.dtype}{arr.shape}, its layout needs "
                                 f"uint8 ({layout.nbytes},)")
            buffer = mx.array(arr)
            mx.eval(buffer)
            return BlockPayload(buffer, layout)
        return pack_named(self._legacy_arrays(arrays, meta))

    def _legacy_arrays(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, str]
                       ) -> dict[str, mx.array]:
        out: dict[str, mx.array] = {}
        for name, arr in arrays.items():
            dtype = meta.get(f"{DTYPE_META_PREFIX}{name}")
            a = mx.array(arr)
            if dtype == _BF16:
                if arr.dtype != np.uint16:
                    raise ValueError(f"bfloat16 array {name!r} must travel as uint16, got {arr.dtype}")
                a = a.view(mx.bfloat16)
            elif dtype is not None:
                raise ValueError(f"unknown dtype metadata for {name!r}: {dtype!r}")
            out[name] = a
        return out


def ram_census(cache: Any, quant: Any = None) -> dict[str, Any]:
    """What the RAM tier of ``cache`` holds, by payload: blocks, tokens, arrays (Metal
    buffers on Apple GPUs), bytes, quantized blocks; per cached token. ``quant`` (a
    ``KVQuant`` or None) is reported as the store's spec. A snapshot walk over the
    pool's blocks (O(blocks); for stats, not for a hot path)."""
    pool = getattr(cache, "pool", None)
    blocks = pool.blocks() if pool is not None else []
    arrays = tokens = nbytes = quantized = 0
    for b in blocks:
        payload = b.payload
        tokens += b.num_tokens
        nbytes += int(b.nbytes)
        if isinstance(payload, BlockPayload):
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
