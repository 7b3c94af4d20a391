"""Block payload <-> safetensors bytes, plus the checksum every tier verifies.

A payload is a flat ``dict[str, np.ndarray]``; string metadata travels in the
safetensors header (``__metadata__``). numpy has no bfloat16: the engine passes
bf16 arrays as ``uint16`` views and records ``dtype.<name>=bfloat16`` in the
metadata; this module carries that entry unchanged and never interprets it.

No pickle: safetensors stores raw little-endian buffers and a JSON header.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as _st_load
from safetensors.numpy import save as _st_save

from .errors import CorruptBlockError

CHECKSUM_ALGORITHM = "sha256"
_HEADER_LEN = struct.Struct("<Q")
# A block header lists a handful of tensors; a larger header is not ours.
_MAX_HEADER_BYTES = 16 * 1024 * 1024


def encode(arrays: Mapping[str, np.ndarray], meta: Mapping[str, str]) -> bytes:
    """Serialize ``arrays`` (name -> numpy array) with string ``meta`` in the header.

    Raises ``ValueError`` for input safetensors cannot represent (non-string
    metadata, object arrays, empty names).
    """
    if not isinstance(arrays, Mapping):
        raise ValueError(f"arrays must be a mapping of name -> np.ndarray, got {type(arrays).__name__}")
    tensors: dict[str, np.ndarray] = {}
    for name, arr in arrays.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"array names must be non-empty strings, got {name!r}")
        if not isinstance(arr, np.ndarray):
            raise ValueError(f"array {name!r} must be a numpy array, got {type(arr).__name__}")
        if arr.dtype == object:
            raise ValueError(f"array {name!r} has dtype object, which cannot be stored")
        tensors[name] = np.ascontiguousarray(arr)
    header_meta: dict[str, str] = {}
    for key, value in meta.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ValueError(f"metadata must map str -> str, got {key!r}: {value!r}")
        header_meta[key] = value
    try:
        return _st_save(tensors, metadata=header_meta or None)
    except (SafetensorError, TypeError, KeyError) as e:
        raise ValueError(f"cannot encode payload: {e}") from e


def read_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors buffer, without touching the tensors."""
    if len(data) < _HEADER_LEN.size:
        raise CorruptBlockError(f"payload too short for a safetensors header ({len(data)} bytes)")
    (n,) = _HEADER_LEN.unpack_from(data, 0)
    if n > _MAX_HEADER_BYTES or _HEADER_LEN.size + n > len(data):
        raise CorruptBlockError(f"safetensors header length {n} does not fit the payload")
    try:
        header = json.loads(bytes(data[_HEADER_LEN.size : _HEADER_LEN.size + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptBlockError(f"safetensors header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise CorruptBlockError("safetensors header is not a JSON object")
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise CorruptBlockError("safetensors __metadata__ is not a str -> str map")
    return dict(meta)


def decode(data: bytes) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Inverse of ``encode``. Raises ``CorruptBlockError`` on anything malformed."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CorruptBlockError(f"payload must be bytes, got {type(data).__name__}")
    data = bytes(data)
    meta = read_metadata(data)
    try:
        arrays = _st_load(data)
    except (SafetensorError, ValueError, KeyError, TypeError) as e:
        raise CorruptBlockError(f"cannot decode safetensors payload: {e}") from e
    return dict(arrays), meta


def checksum(data: bytes) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()
