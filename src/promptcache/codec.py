"""Block format 3: one raw buffer behind a small self-describing header, and the checksum tiers
verify.

u64 LE header length, a JSON header padded to ``ALIGN``, the buffer: a valid safetensors file with
one uint8 tensor ``"block"``. The header holds the block's description (``blockdesc``). Checksums
are xxh3-128 (the chain hash stays sha256). Older formats decode to ``UnsupportedFormatError``. No
pickle.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np
import xxhash

from .blockdesc import BLOCK_HASH_KEY, FORMAT_VERSION, VERSION_KEY, Description, describe
from .blockdesc import read_description as _read_description
from .errors import CorruptBlockError, UnsupportedFormatError
from .meta import BlockMeta

CHECKSUM_ALGORITHM = "xxh3_128"
BLOCK_TENSOR = "block"
ALIGN = 64  # the buffer starts at a multiple of this many bytes (as in RAM: blocklayout.ALIGN)
_HEADER_LEN = struct.Struct("<Q")
# a header lists one tensor and a description (~1 KB for 64 tokens); a larger one is not ours
_MAX_HEADER_BYTES = 16 * 1024 * 1024

Buffer = bytes | bytearray | memoryview


class Decoded(NamedTuple):
    desc: Description
    buffer: np.ndarray  # read-only uint8 view over the decoded bytes


def checksum(data: Buffer) -> str:
    """Hex xxh3-128 of ``data`` (what a tier records and verifies for a stored block)."""
    return xxhash.xxh3_128_hexdigest(data)


def checksum_matches(data: Buffer, digest: str) -> bool:
    """True if ``data`` hashes to ``digest``: xxh3-128 (32 hex), or an older cache's sha256 (64)."""
    if len(digest) == 64:
        return hashlib.sha256(data).hexdigest() == digest
    return checksum(data) == digest


def _as_bytes_view(data: Buffer) -> memoryview:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CorruptBlockError(f"payload must be bytes, got {type(data).__name__}")
    mv = memoryview(data)
    if mv.format != "B" or mv.ndim != 1:
        if not mv.c_contiguous:
            raise CorruptBlockError("payload buffer is not contiguous")
        mv = mv.cast("B")
    return mv


def _as_uint8(buffer: np.ndarray | Buffer) -> np.ndarray:
    arr = np.frombuffer(buffer, dtype=np.uint8) if not isinstance(buffer, np.ndarray) else buffer
    if arr.dtype != np.uint8 or arr.ndim != 1:
        raise ValueError(f"a block buffer is 1-d uint8, got {arr.dtype}{arr.shape}")
    return np.ascontiguousarray(arr)


def encode(meta: BlockMeta, sessions: Iterable[str], layout: str,
           buffer: np.ndarray | Buffer) -> bytes:
    """The stored form of one block: header + buffer; ValueError if the buffer is not 1-d uint8."""
    body = _as_uint8(buffer)
    view = body.data.cast("B")
    desc = Description(meta, tuple(sorted(str(s) for s in sessions)), layout,
                       xxhash.xxh3_128_hexdigest(view))
    n = body.nbytes
    header = {"__metadata__": describe(desc),
              BLOCK_TENSOR: {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(_HEADER_LEN.size + len(raw)) % ALIGN)
    return b"".join((_HEADER_LEN.pack(len(raw)), raw, view))


def read_header(data: Buffer) -> dict[str, str]:
    """The header's string entries, buffer unread (any format); ``CorruptBlockError``."""
    return _metadata(_header(_as_bytes_view(data))[0])


def _header(mv: memoryview) -> tuple[dict[str, object], int]:
    """The parsed JSON header and the offset where the data starts."""
    if mv.nbytes < _HEADER_LEN.size:
        raise CorruptBlockError(f"payload too short for a block header ({mv.nbytes} bytes)")
    (n,) = _HEADER_LEN.unpack_from(mv, 0)
    if n > _MAX_HEADER_BYTES or _HEADER_LEN.size + n > mv.nbytes:
        raise CorruptBlockError(f"block header length {n} does not fit the payload")
    try:
        header = json.loads(bytes(mv[_HEADER_LEN.size : _HEADER_LEN.size + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptBlockError(f"block header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise CorruptBlockError("block header is not a JSON object")
    return header, _HEADER_LEN.size + n


def _metadata(header: dict[str, object]) -> dict[str, str]:
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise CorruptBlockError("block header __metadata__ is not a str -> str map")
    return dict(meta)


def decode(data: Buffer, *, verify: bool = False) -> Decoded:
    """The description and a zero-copy read-only view of the buffer (``data`` must not change
    meanwhile).

    ``verify``: check the buffer's checksum and the chain hash too. Raises
    ``UnsupportedFormatError`` or ``CorruptBlockError``."""
    mv = _as_bytes_view(data)
    header, base = _header(mv)
    meta = _metadata(header)
    old = _other_format(meta)
    if old is not None:
        raise UnsupportedFormatError(f"block format {old} (not this version's: it reads "
                                     f"block format {FORMAT_VERSION} only)")
    spec = header.get(BLOCK_TENSOR)
    if set(header) != {"__metadata__", BLOCK_TENSOR} or not isinstance(spec, dict):
        raise CorruptBlockError("a block header holds its description and one tensor "
                                f"{BLOCK_TENSOR!r}, got {sorted(header)}")
    n = mv.nbytes - base
    if spec != {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}:
        raise CorruptBlockError(f"block tensor {spec!r} does not cover the {n} bytes after "
                                "the header as uint8")
    try:
        desc = _read_description(meta)
    except ValueError as e:
        raise CorruptBlockError(str(e)) from e
    if desc is None:  # unreachable: _other_format said this is our format
        raise CorruptBlockError("block format unknown")
    body = np.frombuffer(mv, dtype=np.uint8, offset=base)
    body.flags.writeable = False
    if verify:
        if xxhash.xxh3_128_hexdigest(mv[base:]) != desc.checksum:
            raise CorruptBlockError("block buffer does not match its xxh3-128")
        if not desc.chain_holds():
            raise CorruptBlockError("block hash does not match its parent, tokens and extra keys")
    return Decoded(desc, body)


def _other_format(meta: dict[str, str]) -> str | None:
    """None if ``meta`` is of this format, else its format; ``CorruptBlockError`` if no block's."""
    v = meta.get(VERSION_KEY)
    if v == FORMAT_VERSION:
        return None
    if v is None and BLOCK_HASH_KEY not in meta:
        raise CorruptBlockError("the header describes no block (no block_hash)")
    return v if v is not None else "1"
