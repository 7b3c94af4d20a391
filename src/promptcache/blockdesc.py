"""Self-describing block payloads: what a tier's index knows about a block, in the
payload's own safetensors metadata, so a lost or corrupt index can be rebuilt from
the block files (``SSDTier``: ``check --fix``) instead of losing them.

Block format 2 (``pc.v`` = ``"2"``) adds to the metadata the cache always wrote
(``block_hash``, ``layout``): ``pc.ns`` (namespace key), ``pc.tenant``, ``pc.parent``
(hex), ``pc.tokens`` (hex of little-endian uint32 token ids), ``pc.start``,
``pc.extra`` (hex of the length-prefixed extra keys), ``pc.nbytes``, ``pc.flags``
(``t``: truncatable, ``s``: snapshot), ``pc.sessions`` (JSON list: the sessions
the block had when it was encoded; the index stays the truth for later ones) and
``pc.sha256`` (over the arrays: name, dtype, shape and bytes, in name order).
Format 1 payloads (no ``pc.v``) still decode as before; ``read_description`` says
None for them. A description is trusted only if ``verify`` holds: the chained
block hash re-derived from parent, tokens and extra keys, and the data digest.

Pure Python + numpy: no I/O, no tier, no MLX.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from .hashing import BlockHash, hash_block
from .meta import BlockMeta

FORMAT_VERSION = "2"
VERSION_KEY = "pc.v"
_KEYS = ("pc.ns", "pc.tenant", "pc.parent", "pc.tokens", "pc.start", "pc.extra",
         "pc.nbytes", "pc.flags", "pc.sessions", "pc.sha256")


@dataclass(frozen=True)
class Description:
    meta: BlockMeta
    sessions: tuple[str, ...]
    sha256: str


def data_digest(arrays: Mapping[str, np.ndarray]) -> str:
    """sha256 over the arrays (name, dtype, shape, bytes), in name order."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        src = arrays[name]
        arr = np.ascontiguousarray(src)
        h.update(struct.pack("<I", len(name.encode())) + name.encode())
        h.update(src.dtype.str.encode() + json.dumps(list(src.shape)).encode())
        h.update(arr.reshape(-1).data.cast("B") if arr.size else b"")
    return h.hexdigest()


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


def describe(meta: BlockMeta, sessions: Iterable[str],
             arrays: Mapping[str, np.ndarray]) -> dict[str, str]:
    """The ``pc.*`` metadata entries of a block payload (format 2)."""
    return {
        VERSION_KEY: FORMAT_VERSION,
        "pc.ns": meta.namespace_key,
        "pc.tenant": meta.tenant,
        "pc.parent": bytes(meta.parent_hash).hex(),
        "pc.tokens": np.asarray(meta.token_ids, dtype="<u4").tobytes().hex(),
        "pc.start": str(int(meta.start)),
        "pc.extra": _pack_extra(meta.extra_keys).hex(),
        "pc.nbytes": str(int(meta.nbytes)),
        "pc.flags": ("t" if meta.truncatable else "") + ("s" if meta.snapshot else ""),
        "pc.sessions": json.dumps(sorted(str(s) for s in sessions)),
        "pc.sha256": data_digest(arrays),
    }


def read_description(payload_meta: Mapping[str, str]) -> Description | None:
    """The description in a payload's metadata; None for a format 1 payload (or a
    later format this build does not know). Raises ValueError if malformed."""
    if payload_meta.get(VERSION_KEY) != FORMAT_VERSION:
        return None
    missing = [k for k in (*_KEYS, "block_hash") if k not in payload_meta]
    if missing:
        raise ValueError(f"block description lacks {missing}")
    try:
        h = bytes.fromhex(payload_meta["block_hash"])
        parent = bytes.fromhex(payload_meta["pc.parent"])
        raw = bytes.fromhex(payload_meta["pc.tokens"])
        if len(raw) % 4:
            raise ValueError("token ids are not uint32")
        tokens = tuple(int(t) for t in np.frombuffer(raw, dtype="<u4").tolist())
        extra = _unpack_extra(bytes.fromhex(payload_meta["pc.extra"]))
        sessions = json.loads(payload_meta["pc.sessions"])
        if not isinstance(sessions, list) or not all(isinstance(s, str) for s in sessions):
            raise ValueError("sessions are not a list of strings")
        flags = payload_meta["pc.flags"]
        meta = BlockMeta(BlockHash(h), BlockHash(parent), tokens,
                         int(payload_meta["pc.start"]), extra_keys=extra,
                         nbytes=int(payload_meta["pc.nbytes"]), truncatable="t" in flags,
                         snapshot="s" in flags, namespace_key=payload_meta["pc.ns"],
                         tenant=payload_meta["pc.tenant"])
    except (ValueError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"malformed block description: {e}") from e
    return Description(meta, tuple(sessions), payload_meta["pc.sha256"])


def verify(desc: Description, arrays: Mapping[str, np.ndarray]) -> bool:
    """True if the description's hash chain link and data digest both hold."""
    m = desc.meta
    if len(m.block_hash) != 32 or len(m.parent_hash) != 32:
        return False
    if hash_block(m.parent_hash, m.token_ids, m.extra_keys) != m.block_hash:
        return False
    return data_digest(arrays) == desc.sha256
