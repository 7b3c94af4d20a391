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
from typing import Any

import numpy as np
from safetensors import SafetensorError
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
        tensors[name] = np.ascontiguousarray(arr).reshape(arr.shape)  # keeps 0-d arrays 0-d
    header_meta: dict[str, str] = {}
    for key, value in meta.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ValueError(f"metadata must map str -> str, got {key!r}: {value!r}")
        header_meta[key] = value
    try:
        return _st_save(tensors, metadata=header_meta or None)
    except (SafetensorError, TypeError, KeyError) as e:
        raise ValueError(f"cannot encode payload: {e}") from e


Buffer = bytes | bytearray | memoryview

# safetensors dtype codes numpy can represent (BF16 and the F8 types have no numpy
# dtype: the engine stores bfloat16 as U16, see the module docstring).
_DTYPES: dict[str, np.dtype[Any]] = {
    code: np.dtype(name).newbyteorder("<")
    for code, name in (
        ("BOOL", "bool"), ("U8", "uint8"), ("I8", "int8"), ("U16", "uint16"),
        ("I16", "int16"), ("F16", "float16"), ("U32", "uint32"), ("I32", "int32"),
        ("F32", "float32"), ("U64", "uint64"), ("I64", "int64"), ("F64", "float64"),
    )
}


def _as_bytes_view(data: Buffer) -> memoryview:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CorruptBlockError(f"payload must be bytes, got {type(data).__name__}")
    mv = memoryview(data)
    if mv.format != "B" or mv.ndim != 1:
        if not mv.c_contiguous:
            raise CorruptBlockError("payload buffer is not contiguous")
        mv = mv.cast("B")
    return mv


def _header(mv: memoryview) -> tuple[dict[str, Any], int]:
    """The parsed JSON header and the offset where the tensor bytes start."""
    if mv.nbytes < _HEADER_LEN.size:
        raise CorruptBlockError(f"payload too short for a safetensors header ({mv.nbytes} bytes)")
    (n,) = _HEADER_LEN.unpack_from(mv, 0)
    if n > _MAX_HEADER_BYTES or _HEADER_LEN.size + n > mv.nbytes:
        raise CorruptBlockError(f"safetensors header length {n} does not fit the payload")
    try:
        header = json.loads(bytes(mv[_HEADER_LEN.size : _HEADER_LEN.size + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptBlockError(f"safetensors header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise CorruptBlockError("safetensors header is not a JSON object")
    return header, _HEADER_LEN.size + n


def _metadata(header: dict[str, Any]) -> dict[str, str]:
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise CorruptBlockError("safetensors __metadata__ is not a str -> str map")
    return dict(meta)


def read_metadata(data: Buffer) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors buffer, without touching the tensors."""
    header, _ = _header(_as_bytes_view(data))
    return _metadata(header)


def _tensor_spec(name: str, spec: Any) -> tuple[int, int, np.dtype[Any], list[int], str]:
    """(begin, end, dtype, shape, name) of one header entry, validated."""
    if type(spec) is not dict:
        raise CorruptBlockError(f"tensor {name!r}: header entry is not an object")
    dtype = _DTYPES.get(spec.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise CorruptBlockError(f"tensor {name!r}: unsupported dtype {spec.get('dtype')!r}")
    shape, offsets = spec.get("shape"), spec.get("data_offsets")
    if type(shape) is not list:
        raise CorruptBlockError(f"tensor {name!r}: bad shape {shape!r}")
    count = 1
    for d in shape:
        if type(d) is not int or d < 0:
            raise CorruptBlockError(f"tensor {name!r}: bad shape {shape!r}")
        count *= d
    if type(offsets) is not list or len(offsets) != 2:
        raise CorruptBlockError(f"tensor {name!r}: bad data_offsets {offsets!r}")
    begin, end = offsets
    if type(begin) is not int or type(end) is not int or not 0 <= begin <= end:
        raise CorruptBlockError(f"tensor {name!r}: bad data_offsets {offsets!r}")
    if count * dtype.itemsize != end - begin:
        raise CorruptBlockError(
            f"tensor {name!r}: shape {shape} x {dtype.itemsize} B does not match {end - begin} bytes"
        )
    return begin, end, dtype, shape, name


def decode(data: Buffer) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Inverse of ``encode``. Raises ``CorruptBlockError`` on anything malformed.

    Zero-copy: the arrays are read-only numpy views over ``data`` (they keep it
    alive). The caller must not modify ``data`` (a ``bytearray``) while the arrays
    are in use; copy them (``mx.array(view)`` does) if they must outlive that.
    The tensor byte ranges must tile the data section exactly, as safetensors
    writes them (no gaps, no overlaps, nothing after the last tensor).
    """
    mv = _as_bytes_view(data)
    header, base = _header(mv)
    meta = _metadata(header)
    specs = [_tensor_spec(n, s) for n, s in header.items() if n != "__metadata__"]
    specs.sort(key=lambda s: (s[0], s[1]))
    pos = 0
    for begin, end, _dtype, _shape, name in specs:
        if begin != pos:
            raise CorruptBlockError(f"tensor {name!r}: data_offsets leave a gap or overlap at {pos}")
        pos = end
    if base + pos != mv.nbytes:
        raise CorruptBlockError(
            f"safetensors data section is {mv.nbytes - base} bytes, tensors cover {pos}"
        )
    body = np.frombuffer(mv, dtype=np.uint8, offset=base)
    body.flags.writeable = False  # the views below inherit it
    return {
        name: body[begin:end].view(dtype).reshape(shape)
        for begin, end, dtype, shape, name in specs
    }, meta


def checksum(data: Buffer) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()
