"""Reconcile the SSD tier's index with its files (startup recovery and test oracle): dead writers'
temp files removed, rows without a file dropped, wrong-size files quarantined, files without a
row removed (only with ``trust_index``; else counted), totals recomputed. The caller holds the
write lock and the exclusive ``DirLock``; without ``fix`` nothing on disk changes."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from . import ssd_segments as segments
from .ssd_files import quarantine, remove_file, scan, temp_is_stale
from .ssd_index import SSDIndex

log = logging.getLogger(__name__)


@dataclass
class CheckReport:
    temp_files: int = 0
    missing_files: int = 0
    wrong_size: int = 0
    orphan_files: int = 0
    index_rebuilt: bool = False
    blocks: int = 0
    bytes: int = 0
    fixed: bool = False
    index_corrupt: bool = False  # the index cannot be used (nothing rebuilt: no ``fix``)
    unindexed_files: int = 0  # block files no usable index describes (kept)
    set_aside_files: int = 0  # ... moved to quarantine/unindexed.<time>/ by a rebuild
    recovered_blocks: int = 0  # rows a rebuild took back from self-describing files
    refused: str | None = None  # why a repair was not done (no folder lock, ...)
    torn_tails: int = 0  # segments with bytes past their last row (cut)

    @property
    def problems(self) -> int:
        return (
            self.temp_files
            + self.missing_files
            + self.wrong_size
            + self.orphan_files
            + int(self.index_rebuilt)
            + int(self.index_corrupt)
            + self.unindexed_files
            + self.torn_tails
        )

    def to_dict(self) -> dict[str, int | bool | str | None]:
        d: dict[str, int | bool | str | None] = dict(asdict(self))
        d["problems"] = self.problems
        return d


def reconcile(root: Path, index: SSDIndex, *, fix: bool, trust_index: bool = True,
              progress: Callable[[int, int], None] | None = None) -> CheckReport:
    """``progress(done, total)``: called every 1024 index rows checked (and at the end)."""
    report = CheckReport(fixed=fix)
    on_disk: dict[str, int] = {}
    for rel, size, kind in scan(root):
        if kind == "temp":
            if not temp_is_stale(root / rel):
                continue  # a live writer's (another process on this folder)
            report.temp_files += 1
            if fix:
                remove_file(root / rel)
        elif kind == "block":
            on_disk[rel] = size
        elif not trust_index:
            report.unindexed_files += 1
        else:
            report.orphan_files += 1
            if fix:
                remove_file(root / rel)

    referenced: set[str] = set()
    drop: list[bytes] = []
    rows = list(index.files())
    seg_rows: list[tuple[bytes, str, int]] = []
    for i, (block_hash, rel, nbytes) in enumerate(rows):
        if progress is not None and i % 1024 == 0:
            progress(i, len(rows))
        if segments.is_segment(rel):
            seg_rows.append((block_hash, rel, nbytes))
            continue
        found = on_disk.get(rel)
        if found is None:
            report.missing_files += 1
            drop.append(block_hash)
            log.warning("ssd check: block %s has no file %s", block_hash.hex()[:16], rel)
            continue
        referenced.add(rel)
        if found != nbytes:
            report.wrong_size += 1
            drop.append(block_hash)
            log.warning(
                "ssd check: block %s file has %d bytes, index says %d",
                block_hash.hex()[:16],
                found,
                nbytes,
            )
            if fix:
                quarantine(root, root / rel, block_hash.hex(), "size")
    _check_segments(root, seg_rows, drop, report, fix=fix, trust_index=trust_index)
    if fix and drop:
        index.begin()
        try:
            index.delete(drop)
            index.commit()
        except BaseException:
            index.rollback()
            raise

    if progress is not None:
        progress(len(rows), len(rows))
    for rel in on_disk:
        if rel in referenced:
            continue
        if not trust_index:
            report.unindexed_files += 1
            continue
        report.orphan_files += 1
        if fix:
            remove_file(root / rel)

    if not fix:
        report.blocks, report.bytes = index.count()
    else:
        index.begin()
        try:
            report.blocks, report.bytes = index.recount()  # (and repairs the kept totals)
            index.commit()
        except BaseException:
            index.rollback()
            raise
    if report.problems:
        log.info("ssd check (fix=%s): %s", fix, report.to_dict())
    return report


def _check_segments(root: Path, rows: list[tuple[bytes, str, int]], drop: list[bytes],
                    report: CheckReport, *, fix: bool, trust_index: bool) -> None:
    """Rows whose segment is missing or too short are dropped (``drop``); a segment
    no writer holds loses its torn tail (bytes past its last row), or goes if no
    row names it; a live writer's segment is left as it is."""
    sizes = dict(segments.segment_files(root))
    ends: dict[str, int] = {}
    for block_hash, ref, nbytes in rows:
        seg, offset = segments.split_ref(ref)
        size = sizes.get(seg)
        if size is None or offset + nbytes > size:
            drop.append(block_hash)
            if size is None:
                report.missing_files += 1
            else:
                report.wrong_size += 1
            log.warning("ssd check: block %s: %s lacks its bytes", block_hash.hex()[:16], ref)
            continue
        ends[seg] = max(ends.get(seg, 0), offset + nbytes)
    for seg, size in sizes.items():
        end = ends.get(seg, 0)
        if (0 < end and size <= end) or segments.in_use(root / seg):
            continue
        if end == 0 and not trust_index:
            report.unindexed_files += 1
        elif end == 0:
            report.orphan_files += 1
            if fix:
                remove_file(root / seg)
        else:
            report.torn_tails += 1
            if fix:
                with open(root / seg, "r+b") as f:
                    f.truncate(end)
                    os.fsync(f.fileno())
