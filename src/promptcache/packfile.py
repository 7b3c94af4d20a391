"""The pack archive format: write, read and verify a portable tar of cached blocks (no pickle).
``read_pack`` verifies every byte (tar checksums, digests, padding, block headers, hash chain)
before any import and fails closed (``PackError``); ``check_target`` refuses another model."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from . import codec
from .errors import CorruptBlockError
from .hashing import CACHE_FORMAT_VERSION, BlockHash, hash_block
from .meta import BlockMeta, Namespace, validate_tenant

log = logging.getLogger(__name__)

PACK_FORMAT = "promptcache-pack"
PACK_VERSION = 1
MANIFEST = "manifest.json"
MANIFEST_DIGEST = "manifest.sha256"
_BLOCK_DIR = "blocks/"
_TAR_BLOCK = 512
_CHUNK = 1024 * 1024
MANIFEST_CHECK_BYTES = 64 * 1024 * 1024  # PackStart parses manifests up to this size

Progress = Callable[[int, int], None]  # (done, total)


class PackError(ValueError):
    """A pack that cannot be written, read or imported (the message says why)."""


@dataclass(frozen=True)
class PackBlock:
    meta: BlockMeta
    data: bytes  # the payload in the cache codec
    sessions: tuple[str, ...] = ()


@dataclass
class Pack:
    namespace: Namespace
    blocks: list[PackBlock]
    selection: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0

    @property
    def num_tokens(self) -> int:
        return max((b.meta.end for b in self.blocks), default=0)

    @property
    def payload_bytes(self) -> int:
        return sum(len(b.data) for b in self.blocks)


@dataclass(frozen=True)
class ImportReport:
    blocks: int  # blocks in the pack
    added: int  # blocks the cache did not hold yet
    tokens: int  # the longest chain's end

    def to_dict(self) -> dict[str, int]:
        return {"blocks": self.blocks, "added": self.added, "tokens": self.tokens}



def _ns_dict(ns: Namespace) -> dict[str, Any]:
    return {"model_fingerprint": ns.model_fingerprint, "block_size": ns.block_size,
            "kv_spec": ns.kv_spec, "tenant": ns.tenant, "format_version": ns.format_version}


def _file_name(h: BlockHash) -> str:
    return f"{_BLOCK_DIR}{h.hex()}.safetensors"


def order_blocks(blocks: Iterable[PackBlock]) -> list[PackBlock]:
    """Parents before children (a parent always starts earlier), stable by hash."""
    return sorted(blocks, key=lambda b: (b.meta.start, b.meta.block_hash))


def manifest_of(ns: Namespace, blocks: Sequence[PackBlock], selection: dict[str, Any],
                created_at: float) -> dict[str, Any]:
    return {
        "format": PACK_FORMAT, "version": PACK_VERSION, "created_at": created_at,
        "namespace": _ns_dict(ns), "selection": selection,
        "blocks": [{
            "hash": b.meta.block_hash.hex(), "parent": b.meta.parent_hash.hex(),
            "start": b.meta.start, "tokens": list(b.meta.token_ids),
            "extra_keys": [k.hex() for k in b.meta.extra_keys], "nbytes": b.meta.nbytes,
            "truncatable": b.meta.truncatable, "snapshot": b.meta.snapshot,
            "sessions": sorted(b.sessions), "file": _file_name(b.meta.block_hash),
            "size": len(b.data), "sha256": hashlib.sha256(b.data).hexdigest(),
        } for b in blocks],
    }


def _add(tar: tarfile.TarFile, name: str, data: bytes, mtime: int) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.type = len(data), mtime, 0o644, tarfile.REGTYPE
    tar.addfile(info, io.BytesIO(data))


def write_pack(out: Path | IO[bytes], ns: Namespace, blocks: Sequence[PackBlock],
               selection: dict[str, Any], *, progress: Progress | None = None,
               clock: Callable[[], float] = time.time) -> dict[str, Any]:
    """Write a pack (to a path atomically); returns ``{"blocks", "tokens", "bytes"}``."""
    blocks = order_blocks(blocks)
    created = round(clock(), 3)
    manifest = json.dumps(manifest_of(ns, blocks, selection, created), sort_keys=True,
                          separators=(",", ":")).encode()
    if isinstance(out, Path):
        fd, tmp = tempfile.mkstemp(prefix=".pack-", dir=out.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                summary = write_pack(f, ns, blocks, selection, progress=progress,
                                     clock=lambda: created)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, out)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return summary
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        mtime = int(created)
        _add(tar, MANIFEST, manifest, mtime)
        _add(tar, MANIFEST_DIGEST, hashlib.sha256(manifest).hexdigest().encode(), mtime)
        for i, b in enumerate(blocks):
            _add(tar, _file_name(b.meta.block_hash), b.data, mtime)
            if progress is not None:
                progress(i + 1, len(blocks))
    return {"blocks": len(blocks), "tokens": max((b.meta.end for b in blocks), default=0),
            "bytes": sum(len(b.data) for b in blocks)}



def _fail(msg: str) -> PackError:
    return PackError(f"refusing the pack: {msg}")


def _manifest(data: bytes) -> dict[str, Any]:
    """A pack's manifest parsed, its format and version checked (PackError)."""
    try:
        man = json.loads(data)
    except ValueError as err:
        raise _fail(f"the manifest is not JSON ({err})") from err
    if not isinstance(man, dict) or man.get("format") != PACK_FORMAT:
        raise _fail("not a promptcache pack")
    if man.get("version") != PACK_VERSION:
        raise _fail(f"pack version {man.get('version')!r} is not supported (this build reads "
                    f"version {PACK_VERSION})")
    return man


def _zeros(f: IO[bytes], start: int, end: int | None) -> bool:
    """Whether ``f``'s bytes from ``start`` to ``end`` (None: its end) are zeros."""
    f.seek(start)
    left = -1 if end is None else end - start
    while left != 0:
        chunk = f.read(_CHUNK if left < 0 else min(left, _CHUNK))
        if not chunk:
            return True
        if chunk.strip(b"\0"):
            return False
        left = -1 if left < 0 else left - len(chunk)
    return True


def _read_members(f: IO[bytes]) -> dict[str, bytes]:
    """The members of a tar whose every byte is accounted for (only member data in memory)."""
    f.seek(0)
    try:
        tar = tarfile.open(fileobj=f, mode="r:")
    except tarfile.TarError as e:
        raise _fail(f"not a readable tar archive ({e})") from e
    names: set[str] = set()
    infos: list[tarfile.TarInfo] = []
    try:
        for m in tar:
            if not m.isreg() or m.pax_headers or m.name in names:
                raise _fail(f"unexpected archive member {m.name!r}")
            if m.name not in (MANIFEST, MANIFEST_DIGEST) and not (
                    m.name.startswith(_BLOCK_DIR) and "/" not in m.name[len(_BLOCK_DIR):]
                    and ".." not in m.name):
                raise _fail(f"unexpected archive member {m.name!r}")
            names.add(m.name)
            infos.append(m)
    except tarfile.TarError as e:
        raise _fail(f"damaged tar archive ({e})") from e
    members: dict[str, bytes] = {}
    pos = 0
    for m in infos:
        if not _zeros(f, pos, m.offset):
            raise _fail(f"unexpected bytes at offset {pos} of the archive")
        f.seek(m.offset_data)
        data = f.read(m.size)
        if len(data) != m.size:
            raise _fail(f"the archive ends inside {m.name!r} (truncated)")
        members[m.name] = data
        pos = m.offset_data + m.size
    if not _zeros(f, pos, None):
        raise _fail(f"unexpected bytes after offset {pos} of the archive (damaged or appended)")
    if f.seek(0, io.SEEK_END) - pos < 2 * _TAR_BLOCK:
        raise _fail("the archive has no end marker (truncated)")
    return members


def _field(d: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    v = d.get(name)
    if not isinstance(v, kind) or isinstance(v, bool) and kind is int:
        raise _fail(f"manifest field {name!r} is missing or has the wrong type")
    return v


def read_pack(source: Path | bytes | IO[bytes], *, progress: Progress | None = None) -> Pack:
    """Read and verify a pack completely (``PackError``): a path, bytes, or a seekable file."""
    if isinstance(source, bytes):
        members = _read_members(io.BytesIO(source))
    elif isinstance(source, Path):
        try:
            with open(source, "rb") as f:
                members = _read_members(f)
        except OSError as err:
            raise PackError(f"cannot read the pack {source}: {err}") from err
    else:
        members = _read_members(source)
    return _verify(members, progress)


def _verify(members: dict[str, bytes], progress: Progress | None) -> Pack:
    manifest_bytes = members.get(MANIFEST)
    if manifest_bytes is None or MANIFEST_DIGEST not in members:
        raise _fail("it has no manifest (not a promptcache pack)")
    if members[MANIFEST_DIGEST].decode("ascii", "replace") != hashlib.sha256(
            manifest_bytes).hexdigest():
        raise _fail("the manifest does not match its sha256 (damaged)")
    man = _manifest(manifest_bytes)
    nsd = _field(man, "namespace", dict)
    try:
        ns = Namespace(_field(nsd, "model_fingerprint", str), _field(nsd, "block_size", int),
                       _field(nsd, "kv_spec", str), validate_tenant(_field(nsd, "tenant", str)),
                       _field(nsd, "format_version", int))
    except ValueError as err:
        raise _fail(f"bad namespace in the manifest ({err})") from err
    entries = _field(man, "blocks", list)
    expected_files = {MANIFEST, MANIFEST_DIGEST}
    ends: dict[BlockHash, int] = {ns.root: 0}
    blocks: list[PackBlock] = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise _fail(f"block entry {i} is not an object")
        try:
            h = BlockHash(bytes.fromhex(_field(e, "hash", str)))
            parent = BlockHash(bytes.fromhex(_field(e, "parent", str)))
            tokens = tuple(int(t) for t in _field(e, "tokens", list))
            extra = tuple(bytes.fromhex(k) for k in _field(e, "extra_keys", list))
        except (ValueError, TypeError) as err:
            raise _fail(f"block entry {i} is malformed ({err})") from err
        start = _field(e, "start", int)
        name = _field(e, "file", str)
        if name != _file_name(h):
            raise _fail(f"block {i} names the file {name!r}")
        if parent not in ends or ends[parent] != start:
            raise _fail(f"block {i} ({h.hex()[:16]}) does not continue a chain of the pack "
                        "from the namespace root")
        if not 0 < len(tokens) <= ns.block_size or any(not 0 <= t < 2**32 for t in tokens):
            raise _fail(f"block {i} has a bad token count or token id")
        if hash_block(parent, tokens, extra) != h:
            raise _fail(f"block {i} ({h.hex()[:16]}): its hash does not match its parent, "
                        "tokens and extra keys")
        data = members.get(name)
        if data is None:
            raise _fail(f"block file {name} is missing")
        expected_files.add(name)
        if len(data) != _field(e, "size", int) or hashlib.sha256(data).hexdigest() != _field(
                e, "sha256", str):
            raise _fail(f"block file {name} does not match its sha256 (damaged)")
        try:
            dec = codec.decode(data, verify=True)
        except CorruptBlockError as err:
            raise _fail(f"block file {name} is not a valid payload ({err})") from err
        if dec.desc.meta.block_hash != h:
            raise _fail(f"block file {name} holds another block's payload")
        sessions = _field(e, "sessions", list)
        if not all(isinstance(s, str) and s for s in sessions):
            raise _fail(f"block {i} has a bad session id")
        meta = BlockMeta(block_hash=h, parent_hash=parent, token_ids=tokens, start=start,
                         extra_keys=extra, nbytes=_field(e, "nbytes", int),
                         truncatable=_field(e, "truncatable", bool),
                         snapshot=_field(e, "snapshot", bool), namespace_key=ns.key,
                         tenant=ns.tenant)
        if len(tokens) == ns.block_size:
            ends[h] = meta.end  # only full blocks have children
        blocks.append(PackBlock(meta, data, tuple(sessions)))
        if progress is not None:
            progress(i + 1, len(entries))
    if set(members) != expected_files:
        extra_names = sorted(set(members) - expected_files)
        raise _fail(f"archive members not in the manifest: {extra_names[:3]}")
    selection = man.get("selection")
    created = man.get("created_at")
    return Pack(ns, blocks, selection if isinstance(selection, dict) else {},
                float(created) if isinstance(created, int | float) else 0.0)


class PackStart:
    """Checks an upload's first bytes (``manifest.json``, a known version): ``PackError`` early."""

    def __init__(self) -> None:
        self._head = b""
        self._want = _TAR_BLOCK
        self.done = False

    def feed(self, chunk: bytes) -> None:
        while not self.done:
            take = chunk[:self._want - len(self._head)]
            chunk = chunk[len(take):]
            self._head += take
            if len(self._head) < self._want:
                return
            self._check()

    def _check(self) -> None:
        if self._want == _TAR_BLOCK:
            try:
                info = tarfile.TarInfo.frombuf(self._head, "utf-8", "surrogateescape")
            except tarfile.HeaderError as e:
                raise _fail(f"it does not start like a pack: not a tar archive ({e})") from e
            if info.name != MANIFEST or not info.isreg():
                raise _fail(f"it does not start like a pack: the first member is "
                            f"{info.name!r}, not {MANIFEST}")
            if info.size > MANIFEST_CHECK_BYTES:
                self.done = True  # too long to hold here: read_pack checks it
                return
            self._want = _TAR_BLOCK + info.size
            return
        self.done = True
        _manifest(self._head[_TAR_BLOCK:])


def check_target(pack: Pack, target: Namespace) -> None:
    """Refuse a pack made for another model / block size / KV spec / cache format."""
    p = pack.namespace
    if p.model_fingerprint != target.model_fingerprint:
        raise _fail(f"it was exported from another model (fingerprint "
                    f"{p.model_fingerprint[:16]}..., this cache serves "
                    f"{target.model_fingerprint[:16]}...)")
    for what, a, b in (("block size", p.block_size, target.block_size),
                       ("KV spec", p.kv_spec, target.kv_spec),
                       ("cache format version", p.format_version, target.format_version)):
        if a != b:
            raise _fail(f"its {what} is {a!r}, this cache uses {b!r}")
    if p.format_version != CACHE_FORMAT_VERSION:
        raise _fail(f"cache format version {p.format_version} is not this build's")
