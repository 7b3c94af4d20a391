"""KV quantization of cached blocks (``--kv-bits``): mlx-lm's ``QuantizedKVCache`` layout, filled
directly or dequantized on restore. Live caches are never quantized; blocks before ``min_tokens``
stay exact."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

logger = logging.getLogger(__name__)

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)  # what mx.quantize supports in affine mode
DEFAULT_GROUP_SIZE = 64
DEFAULT_MIN_TOKENS = 256


@dataclass(frozen=True, slots=True)
class KVQuant:
    """How cached KV blocks are quantized (None anywhere means full precision)."""

    bits: int
    group_size: int = DEFAULT_GROUP_SIZE
    min_tokens: int = DEFAULT_MIN_TOKENS

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or self.bits not in BITS:
            raise ValueError(f"kv bits must be one of {BITS}, got {self.bits!r}")
        if isinstance(self.group_size, bool) or self.group_size not in GROUP_SIZES:
            raise ValueError(f"kv group size must be one of {GROUP_SIZES}, got {self.group_size!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) \
                or self.min_tokens < 0:
            raise ValueError(f"kv quantization min tokens must be an integer >= 0, "
                             f"got {self.min_tokens!r}")

    @property
    def spec(self) -> str:
        """The namespace string, e.g. ``q8g64m256``."""
        return f"q{self.bits}g{self.group_size}m{self.min_tokens}"

    def group_for(self, head_dim: int) -> int | None:
        """The group size for ``head_dim`` (the configured one, else a smaller divisor) or None."""
        for g in sorted(GROUP_SIZES, reverse=True):
            if g <= self.group_size and head_dim % g == 0:
                return g
        return None

    def applies_to(self, start: int) -> bool:
        """Whether the block starting at token ``start`` is quantized."""
        return start >= self.min_tokens


def from_config(config: Any) -> KVQuant | None:
    """The spec of a ``CacheConfig`` (``kv_bits`` None: full precision)."""
    bits = getattr(config, "kv_bits", None)
    if bits is None:
        return None
    return KVQuant(bits, getattr(config, "kv_group_size", DEFAULT_GROUP_SIZE),
                   getattr(config, "kv_quant_min_tokens", DEFAULT_MIN_TOKENS))


def quantize(x: mx.array, bits: int, group_size: int) -> tuple[mx.array, mx.array, mx.array]:
    """``(packed, scales, biases)`` of ``x`` (``[..., head_dim]``), grouped along head_dim."""
    wq, scales, biases = mx.quantize(x, group_size=group_size, bits=bits)
    return wq, scales, biases


def dequantize(parts: Sequence[mx.array], bits: int, group_size: int) -> mx.array:
    """The inverse of ``quantize``; on CPU byte-aligned widths unpack elementwise (faster)."""
    wq, scales, biases = parts  # packed values, scales, biases
    if 8 % bits or mx.default_device().type != mx.DeviceType.cpu:
        return mx.dequantize(wq, scales, biases, group_size=group_size, bits=bits)
    return _dequantize_bytes(wq, scales, biases, bits, group_size)


def _dequantize_bytes(wq: mx.array, scales: mx.array, biases: mx.array, bits: int,
                      group_size: int) -> mx.array:
    q = wq.view(mx.uint8)  # little-endian: value 0 in the lowest bits of byte 0
    if bits < 8:
        mask = (1 << bits) - 1
        q = mx.stack([(q >> (bits * i)) & mask for i in range(8 // bits)], axis=-1)
    *lead, _ = wq.shape
    dim = scales.shape[-1] * group_size
    groups = q.reshape(*lead, dim // group_size, group_size).astype(scales.dtype)
    out = groups * mx.expand_dims(scales, -1) + mx.expand_dims(biases, -1)
    return out.reshape(*lead, dim)


def packed_dim(head_dim: int, bits: int) -> int:
    """The last dimension of the packed ``uint32`` array."""
    return head_dim * bits // 32


def quantized_nbytes(shape: tuple[int, ...], itemsize: int, bits: int, group_size: int) -> int:
    """Bytes of the three parts of a quantized ``shape`` array (scales of ``itemsize``)."""
    rows = 1
    for d in shape[:-1]:
        rows *= d
    head_dim = shape[-1]
    return rows * (packed_dim(head_dim, bits) * 4 + 2 * (head_dim // group_size) * itemsize)
