"""Chained block hashes (``sha256(parent || token ids || extra keys)``) and namespace roots,
deterministic across processes and machines."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any, NewType

import numpy as np

BlockHash = NewType("BlockHash", bytes)
"""A 32-byte sha256 digest identifying a block and (through the chain) its whole prefix."""

# part of every namespace root: a new version ignores old data (2: MLA layouts)
CACHE_FORMAT_VERSION = 2
MAX_TOKEN_ID = 2**32 - 1

_ROOT_TAG = b"promptcache/root/v1\x00"
_BLOCK_TAG = b"promptcache/block/v1\x00"


def validate_tokens(tokens: Any, *, allow_empty: bool = False) -> tuple[int, ...]:
    """``tokens`` as a tuple of ints; ValueError for floats, bools, negatives, >= 2**32."""
    if isinstance(tokens, (str, bytes)):
        raise ValueError("token ids must be a sequence of integers, not a string")
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1:
            raise ValueError(f"token ids must be a 1-D array, got shape {tokens.shape}")
        if not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"token ids must have an integer dtype, got {tokens.dtype}")
        out = tuple(int(t) for t in tokens.tolist())
    else:
        try:
            seq = list(tokens)
        except TypeError:
            raise ValueError(
                f"token ids must be a sequence of integers, got {type(tokens).__name__}"
            ) from None
        for i, t in enumerate(seq):
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise ValueError(
                    f"token id at position {i} is not an integer: {t!r} ({type(t).__name__})"
                )
        out = tuple(int(t) for t in seq)
    if not out and not allow_empty:
        raise ValueError("token ids must not be empty")
    for i, t in enumerate(out):
        if t < 0 or t > MAX_TOKEN_ID:
            raise ValueError(f"token id at position {i} is out of range [0, 2**32): {t}")
    return out


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    return np.asarray(token_ids, dtype="<u4").tobytes()


def namespace_root(
    *,
    model_fingerprint: str,
    block_size: int,
    kv_spec: str,
    tenant: str,
    format_version: int = CACHE_FORMAT_VERSION,
) -> BlockHash:
    """Root of a namespace's hash chains: fingerprint, format, block size, KV spec, tenant."""
    h = hashlib.sha256(_ROOT_TAG)
    for part in (str(format_version), model_fingerprint, str(block_size), kv_spec, tenant):
        data = part.encode("utf-8")
        h.update(struct.pack("<I", len(data)))
        h.update(data)
    return BlockHash(h.digest())


def hash_block(
    parent: BlockHash, token_ids: Sequence[int], extra_keys: Sequence[bytes] = ()
) -> BlockHash:
    """The chained hash of one block: H(parent, token ids, extra keys)."""
    if len(parent) != 32:
        raise ValueError(f"parent hash must be 32 bytes, got {len(parent)}")
    h = hashlib.sha256(_BLOCK_TAG)
    h.update(parent)
    h.update(struct.pack("<I", len(token_ids)))
    h.update(_pack_tokens(token_ids))
    h.update(struct.pack("<I", len(extra_keys)))
    for key in extra_keys:
        h.update(struct.pack("<I", len(key)))
        h.update(key)
    return BlockHash(h.digest())


def chain_hashes(
    root: BlockHash,
    token_ids: Sequence[int],
    block_size: int,
    extra_keys_for: Any = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids``, each with ``extra_keys_for(start, end)``."""
    out: list[BlockHash] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        end = start + block_size
        extra = extra_keys_for(start, end) if extra_keys_for is not None else ()
        parent = hash_block(parent, token_ids[start:end], extra)
        out.append(parent)
    return out
