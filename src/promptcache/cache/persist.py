"""What ``persist`` reports (``PromptCache.last_persist``), and how it checks that the
blocks it handed to the asynchronous tiers arrived (``LowerWriter.persist``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..blocks.pool import Block
from ..meta import Namespace
from ..tiers.base import Tier

PROGRESS_EVERY_S = 2.0
NAMED_FAILURES = 10  # failed blocks named in the persist log line


@dataclass
class PersistReport:
    """One ``persist``: blocks to write, written, and those missing in some lower tier."""

    blocks: int = 0
    written: int = 0
    failed: int = 0
    timed_out: bool = False
    seconds: float = 0.0
    failed_names: list[str] = field(default_factory=list)


def block_name(block: Block) -> str:
    h = block.block_hash.hex()[:16] if block.block_hash is not None else "private"
    return f"{block.ns.tenant}@{block.start}:{h}"


def missing(tiers: Sequence[Tier], blocks: list[Block],
            on_tier_error: Callable[[Tier, Exception], None]) -> dict[int, set[int]]:
    """After a flush: ``{id(block): tiers that lack it}`` over the asynchronous tiers
    (those with ``flush``), asked with one ``get_metas`` per tier and namespace."""
    by_ns: dict[Namespace, list[Block]] = {}
    for b in blocks:
        by_ns.setdefault(b.ns, []).append(b)
    out: dict[int, set[int]] = {}
    for i, tier in enumerate(tiers):
        if getattr(tier, "flush", None) is None:
            continue
        for ns, group in by_ns.items():
            try:
                metas = tier.get_metas([b.meta().block_hash for b in group], ns=ns)
                if len(metas) != len(group):
                    raise ValueError("get_metas returned a wrong number of entries")
            except Exception as e:
                on_tier_error(tier, e)
                metas = [None] * len(group)
            for b, m in zip(group, metas, strict=True):
                if m is None:
                    out.setdefault(id(b), set()).add(i)
    return out
