"""Self-describing blocks: a tier index's row in the block's own header (``codec``), so a lost index
can be rebuilt (``check --fix``). Trusted only if ``verify`` holds. No I/O, no MLX."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import xxhash

from .hashing import BlockHash, hash_block
from .meta import BlockMeta

FORMAT_VERSION = "3"
VERSION_KEY = "pc.v"
BLOCK_HASH_KEY = "block_hash"
LAYOUT_KEY = "layout"
CHECKSUM_KEY = "pc.xxh3"
_KEYS = (BLOCK_HASH_KEY, LAYOUT_KEY, "pc.ns", "pc.tenant", "pc.parent", "pc.tokens",
         "pc.start", "pc.extra", "pc.nbytes", "pc.flags", "pc.sessions", CHECKSUM_KEY)


@dataclass(frozen=True)
class Description:
    """A block as its header describes it: metadata, sessions, layout, buffer xxh3-128."""

    meta: BlockMeta
    sessions: tuple[str, ...]
    layout: str
    checksum: str

    def chain_holds(self) -> bool:
        """True if the block hash is the chained hash of parent, tokens and extra keys."""
        m = self.meta
        if len(m.block_hash) != 32 or len(m.parent_hash) != 32:
            return False
        return hash_block(m.parent_hash, m.token_ids, m.extra_keys) == m.block_hash


def _pack_extra(keys: Iterable[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(k)) + k for k in keys)


def _unpack_extra(blob: bytes) -> tuple[bytes, ...]:
    out: list[bytes] = []
    i = 0
    while i < len(blob):
        if i + 4 > len(blob):
            raise ValueError("truncated extra keys")
        (n,) = struct.unpack_from("<I", blob, i)
        if i + 4 + n > len(blob):
            raise ValueError("truncated extra keys")
        out.append(bytes(blob[i + 4: i + 4 + n]))
        i += 4 + n
    return tuple(out)


def describe(desc: Description) -> dict[str, str]:
    """The header entries of a block (format 3)."""
    meta = desc.meta
    if not isinstance(desc.layout, str):
        raise ValueError(f"a block layout is a string, got {type(desc.layout).__name__}")
    return {
        VERSION_KEY: FORMAT_VERSION,
        BLOCK_HASH_KEY: bytes(meta.block_hash).hex(),
        LAYOUT_KEY: desc.layout,
        "pc.ns": meta.namespace_key,
        "pc.tenant": meta.tenant,
        "pc.parent": bytes(meta.parent_hash).hex(),
        "pc.tokens": np.asarray(meta.token_ids, dtype="<u4").tobytes().hex(),
        "pc.start": str(int(meta.start)),
        "pc.extra": _pack_extra(meta.extra_keys).hex(),
        "pc.nbytes": str(int(meta.nbytes)),
        "pc.flags": ("t" if meta.truncatable else "") + ("s" if meta.snapshot else ""),
        "pc.sessions": json.dumps(sorted(str(s) for s in desc.sessions)),
        CHECKSUM_KEY: desc.checksum,
    }


def read_description(header: Mapping[str, str]) -> Description | None:
    """The description in a block's header; None for format 1, 2 or unknown; ValueError if bad."""
    if header.get(VERSION_KEY) != FORMAT_VERSION:
        return None
    missing = [k for k in _KEYS if k not in header]
    if missing:
        raise ValueError(f"block description lacks {missing}")
    try:
        h = bytes.fromhex(header[BLOCK_HASH_KEY])
        parent = bytes.fromhex(header["pc.parent"])
        raw = bytes.fromhex(header["pc.tokens"])
        if len(raw) % 4:
            raise ValueError("token ids are not uint32")
        tokens = tuple(int(t) for t in np.frombuffer(raw, dtype="<u4").tolist())
        extra = _unpack_extra(bytes.fromhex(header["pc.extra"]))
        sessions = json.loads(header["pc.sessions"])
        if not isinstance(sessions, list) or not all(isinstance(s, str) for s in sessions):
            raise ValueError("sessions are not a list of strings")
        flags = header["pc.flags"]
        meta = BlockMeta(BlockHash(h), BlockHash(parent), tokens,
                         int(header["pc.start"]), extra_keys=extra,
                         nbytes=int(header["pc.nbytes"]), truncatable="t" in flags,
                         snapshot="s" in flags, namespace_key=header["pc.ns"],
                         tenant=header["pc.tenant"])
    except (ValueError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"malformed block description: {e}") from e
    return Description(meta, tuple(sessions), header[LAYOUT_KEY], header[CHECKSUM_KEY])


def verify(desc: Description, buffer: np.ndarray | bytes) -> bool:
    """True if the hash chain link holds and ``buffer`` matches its xxh3-128."""
    data = np.ascontiguousarray(buffer).data.cast("B") if isinstance(buffer, np.ndarray) else buffer
    return desc.chain_holds() and xxhash.xxh3_128_hexdigest(data) == desc.checksum
