"""Cache packs: export a conversation's, session's or tenant's blocks (parents included) into a pack
(``packfile``); import a verified pack into a cache or one lower tier."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from . import codec
from .errors import CorruptBlockError, UnsupportedFormatError
from .hashing import BlockHash
from .meta import BlockMeta, Namespace
from .packfile import (
    ImportReport,
    Pack,
    PackBlock,
    PackError,
    Progress,
    check_target,
    order_blocks,
)


class _Cache(Protocol):
    lower: Any

    def lookup(self, tokens: Any, ns: Namespace) -> Any: ...
    def ram_metas(self, ns: Namespace, session_id: str | None = None) -> list[BlockMeta]: ...
    def read_block(self, block_hash: BlockHash, ns: Namespace
                   ) -> tuple[BlockMeta, bytes, tuple[str, ...]] | None: ...
    def import_block(self, meta: BlockMeta, data: bytes, sessions: Sequence[str],
                     ns: Namespace) -> bool: ...


def _lower_hashes(cache: _Cache, ns: Namespace, session_id: str | None) -> list[BlockHash]:
    """Blocks of ``ns`` (and the session) in the lower tiers that can list their rows."""
    out: list[BlockHash] = []
    for tier in cache.lower:
        rows = getattr(tier, "rows", None)
        if rows is None:
            continue
        for r in rows(ns.tenant):
            if r.meta.namespace_key != ns.key:
                continue
            if session_id is not None and session_id not in tier.sessions_of(
                    r.meta.block_hash, ns=ns):
                continue
            out.append(r.meta.block_hash)
    return out


def collect(cache: _Cache, ns: Namespace, *, tokens: Sequence[int] | None = None,
            session_id: str | None = None, progress: Progress | None = None
            ) -> list[PackBlock]:
    """The blocks of a conversation (``tokens``), a session, or the tenant, parents included."""
    if tokens is not None:
        match = cache.lookup(list(tokens), ns)
        wanted = [m.block_hash for m in match.blocks]
    else:
        wanted = [m.block_hash for m in cache.ram_metas(ns, session_id)]
        wanted += _lower_hashes(cache, ns, session_id)
    got: dict[BlockHash, PackBlock] = {}
    todo = list(dict.fromkeys(wanted))
    queued = set(todo)
    while todo:
        h = todo.pop()
        rec = cache.read_block(h, ns)
        if rec is None:
            raise PackError(f"block {h.hex()[:16]} vanished during the export; try again")
        meta, data, sessions = rec
        try:
            codec.decode(data)
        except UnsupportedFormatError as e:
            raise PackError(f"block {h.hex()[:16]} is stored in an older block format ({e}): "
                            "it is rewritten once a request recomputes it") from e
        except CorruptBlockError as e:
            raise PackError(f"block {h.hex()[:16]} cannot be read ({e})") from e
        got[h] = PackBlock(meta, data, sessions)
        if meta.parent_hash != ns.root and meta.parent_hash not in queued:
            todo.append(meta.parent_hash)
            queued.add(meta.parent_hash)
        if progress is not None:
            progress(len(got), len(queued))
    return order_blocks(got.values())


def import_into(cache: _Cache, pack: Pack, target: Namespace,
                progress: Progress | None = None) -> ImportReport:
    """Import a verified pack into a cache whose namespace for the pack's tenant is ``target``."""
    check_target(pack, target)
    added = 0
    for i, b in enumerate(pack.blocks):
        added += bool(cache.import_block(b.meta, b.data, b.sessions, target))
        if progress is not None:
            progress(i + 1, len(pack.blocks))
    return ImportReport(len(pack.blocks), added, pack.num_tokens)


def import_into_tier(tier: Any, pack: Pack, target: Namespace,
                     progress: Progress | None = None) -> ImportReport:
    """Import a verified pack straight into one lower tier (e.g. an SSD folder)."""
    check_target(pack, target)
    added = 0
    for i, b in enumerate(pack.blocks):
        if tier.get_meta(b.meta.block_hash, ns=target) is None:
            if not tier.put(b.meta, b.data, b.sessions, timeout=None):
                raise PackError(f"the tier refused block {b.meta.block_hash.hex()[:16]}")
            added += 1
        elif b.sessions:
            tier.add_sessions(b.meta.block_hash, b.sessions, ns=target)
        if progress is not None:
            progress(i + 1, len(pack.blocks))
    flush = getattr(tier, "flush", None)
    if flush is not None and not flush(None):
        raise PackError("the tier did not finish writing the imported blocks")
    return ImportReport(len(pack.blocks), added, pack.num_tokens)
