"""What the matcher finds: a RAM block or a lower tier's entry, and the raw match."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..blocks.pool import Block
from ..hashing import BlockHash
from ..meta import BlockMeta, Namespace
from .miss import CacheMiss

RAM = "ram"


class MetaSource(Protocol):
    """The metadata half of a lower tier (``tiers.base.Tier``). ``ns``: the namespace
    the hashes belong to (a tier whose keys carry it, e.g. Redis, needs it)."""

    name: str

    def get_metas(self, block_hashes: Sequence[BlockHash], *, ns: Namespace | None = None
                  ) -> list[BlockMeta | None]: ...

    def children(self, parent_hash: BlockHash, *, ns: Namespace | None = None
                 ) -> list[BlockMeta]: ...


class LowerEntry:
    __slots__ = ("meta", "source")

    def __init__(self, meta: BlockMeta, source: MetaSource) -> None:
        self.meta = meta
        self.source = source

    @property
    def start(self) -> int:
        return self.meta.start

    @property
    def end(self) -> int:
        return self.meta.end


Entry = Block | LowerEntry


def entry_tier(entry: Entry) -> str:
    return RAM if isinstance(entry, Block) else entry.source.name


def entry_meta(entry: Entry) -> BlockMeta:
    return entry.meta() if isinstance(entry, Block) else entry.meta


@dataclass(slots=True)
class RawMatch:
    """``entries`` cover ``[0, num_tokens)`` (the last may extend past it: truncated)."""

    entries: list[Entry]
    num_tokens: int
    matched_tokens: int
    miss: CacheMiss | None

