"""The Redis tier's key layout and block records (pure: no redis import, no I/O).

Keys start ``<prefix>:v<format>:<tenant>:``. Per block ``<ns>:b:<hash>`` (a HASH: ``m`` record,
``p`` payload, ``s:<session>``), ``<ns>:k:<parent>`` the children index, ``s:<session digest>`` the
session's blocks. Records are verified by recomputing the block hash."""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CorruptBlockError
from ..hashing import CACHE_FORMAT_VERSION, BlockHash, hash_block
from ..meta import BlockMeta, validate_tenant

RECORD_VERSION = 1
META_FIELD = b"m"
PAYLOAD_FIELD = b"p"
SESSION_FIELD_PREFIX = b"s:"


def session_digest(session_id: str) -> str:
    """Session ids are client-chosen strings: keys carry a digest, never the id."""
    return hashlib.sha256(session_id.encode("utf-8")).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class KeySpace:
    """Builds the tier's keys (see the module docstring)."""

    prefix: str
    format_version: int = CACHE_FORMAT_VERSION

    @property
    def base(self) -> str:
        return f"{self.prefix}:v{self.format_version}"

    def block(self, tenant: str, ns_key: str, block_hash: bytes) -> str:
        return f"{self.base}:{tenant}:{ns_key}:b:{block_hash.hex()}"

    def kids(self, tenant: str, ns_key: str, parent_hash: bytes) -> str:
        return f"{self.base}:{tenant}:{ns_key}:k:{parent_hash.hex()}"

    def session(self, tenant: str, session_id: str) -> str:
        return f"{self.base}:{tenant}:s:{session_digest(session_id)}"

    def tenant_pattern(self, tenant: str | None) -> str:
        """SCAN pattern of every key of ``tenant`` (None: of every tenant)."""
        if tenant is None:
            return f"{self.base}:*"
        validate_tenant(tenant)  # its alphabet has no glob characters
        return f"{self.base}:{tenant}:*"

    def session_pattern(self, session_id: str) -> str:
        """SCAN pattern of a session's sets in every tenant."""
        return f"{self.base}:*:s:{session_digest(session_id)}"

    @staticmethod
    def member(ns_key: str, block_hash: bytes, parent_hash: bytes) -> str:
        return f"{ns_key}:{block_hash.hex()}:{parent_hash.hex()}"

    @staticmethod
    def parse_member(member: bytes | str) -> tuple[str, bytes, bytes]:
        text = member.decode("ascii") if isinstance(member, bytes) else member
        ns_key, h, parent = text.split(":")
        return ns_key, bytes.fromhex(h), bytes.fromhex(parent)


def encode_record(meta: BlockMeta, payload_len: int, payload_checksum: str) -> bytes:
    """The metadata record stored beside (and in the children index of) a block."""
    return json.dumps(
        {
            "v": RECORD_VERSION,
            "h": meta.block_hash.hex(),
            "p": meta.parent_hash.hex(),
            "s": meta.start,
            "t": base64.b64encode(np.asarray(meta.token_ids, dtype="<u4").tobytes()).decode(),
            "x": [k.hex() for k in meta.extra_keys],
            "n": meta.nbytes,
            "tr": meta.truncatable,
            "sn": meta.snapshot,
            "ns": meta.namespace_key,
            "te": meta.tenant,
            "l": payload_len,
            "c": payload_checksum,
        },
        separators=(",", ":"),
    ).encode()


def record_parent(data: bytes) -> bytes | None:
    """The parent hash named by a (possibly damaged) record, if it can be read."""
    try:
        parent = bytes.fromhex(json.loads(data)["p"])
    except (ValueError, TypeError, KeyError, UnicodeDecodeError):
        return None
    return parent if len(parent) == 32 else None


@dataclass(frozen=True, slots=True)
class Record:
    meta: BlockMeta
    payload_len: int
    payload_checksum: str  # xxh3-128 hex (sha256 in a record an older cache wrote)


def _field(obj: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    v = obj.get(name)
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise CorruptBlockError(f"redis block record: field {name!r} is missing or malformed")
    return v


def decode_record(data: bytes, *, block_hash: bytes, ns_key: str, tenant: str) -> Record:
    """Parse and verify a record read under ``block_hash``; else ``CorruptBlockError``."""
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError) as e:
        raise CorruptBlockError(f"redis block record is not valid JSON: {e}") from e
    if not isinstance(obj, dict) or obj.get("v") != RECORD_VERSION:
        raise CorruptBlockError("redis block record has an unknown version")
    try:
        h = bytes.fromhex(_field(obj, "h", str))
        parent = bytes.fromhex(_field(obj, "p", str))
        tokens_raw = base64.b64decode(_field(obj, "t", str), validate=True)
        extra = tuple(bytes.fromhex(x) for x in _field(obj, "x", list))
    except (ValueError, TypeError) as e:
        raise CorruptBlockError(f"redis block record: bad encoding: {e}") from e
    start = _field(obj, "s", int)
    nbytes = _field(obj, "n", int)
    length = _field(obj, "l", int)
    digest = _field(obj, "c", str)
    trunc = _field(obj, "tr", bool)
    snap = _field(obj, "sn", bool)
    if _field(obj, "ns", str) != ns_key or _field(obj, "te", str) != tenant:
        raise CorruptBlockError("redis block record belongs to another namespace")
    if len(parent) != 32 or h != block_hash or len(tokens_raw) % 4 or not tokens_raw:
        raise CorruptBlockError("redis block record does not match its key")
    if start < 0 or nbytes < 0 or length < 0 or len(digest) not in (32, 64):
        raise CorruptBlockError("redis block record has out-of-range sizes")
    token_ids = tuple(np.frombuffer(tokens_raw, dtype="<u4").tolist())
    if hash_block(BlockHash(parent), token_ids, extra) != block_hash:
        raise CorruptBlockError("redis block record: its tokens do not hash to its key")
    meta = BlockMeta(
        block_hash=BlockHash(h), parent_hash=BlockHash(parent), token_ids=token_ids,
        start=start, extra_keys=extra, nbytes=nbytes, truncatable=trunc, snapshot=snap,
        namespace_key=ns_key, tenant=tenant,
    )
    return Record(meta, length, digest)
