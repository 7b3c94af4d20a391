"""The MLX ``PayloadAdapter``: block payloads of ``mx.array`` <-> numpy.

The cache core keeps payloads opaque and asks the adapter only for sizes (from
shape x dtype, never evaluating) and for a numpy form when a block goes to a
lower tier (``codec`` turns that into safetensors bytes). numpy has no
bfloat16: such arrays travel as ``uint16`` views with a ``dtype.<name>=bfloat16``
metadata entry, which ``from_numpy`` reads to view them back.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import mlx.core as mx
import numpy as np

logger = logging.getLogger(__name__)

DTYPE_META_PREFIX = "dtype."
_BF16 = "bfloat16"


class MLXPayloadAdapter:
    """Payload adapter for ``dict[str, mx.array]`` block payloads."""

    name = "mlx"

    def nbytes(self, payload: Mapping[str, Any]) -> int:
        """Bytes from shape x dtype metadata (``mx.array.nbytes`` does not evaluate)."""
        return sum(int(a.nbytes) for a in payload.values())

    def to_numpy(self, payload: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """numpy copies of the arrays; bfloat16 arrays become ``uint16`` views."""
        return self.to_numpy_with_meta(payload)[0]

    def meta(self, payload: Mapping[str, Any]) -> dict[str, str]:
        """The metadata entries ``to_numpy`` implies (``dtype.<name>=bfloat16``)."""
        return {
            f"{DTYPE_META_PREFIX}{name}": _BF16
            for name, a in payload.items()
            if isinstance(a, mx.array) and a.dtype == mx.bfloat16
        }

    def to_numpy_with_meta(
        self, payload: Mapping[str, Any]
    ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
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
    ) -> dict[str, mx.array]:
        """Inverse of ``to_numpy``; ``meta`` restores bfloat16 arrays."""
        meta = meta or {}
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
        mx.eval(list(out.values()))
        return out
