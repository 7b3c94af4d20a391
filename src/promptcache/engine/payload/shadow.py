"""Shadow verification: recompute restored blocks in idle time and compare (a checksum cannot see a
valid payload swapped for another).

Samples restoring hits (``fraction``); one prefill chunk per idle ``step()``. A mismatch in K/V,
snapshots or next-token logits (beyond ``atol + rtol * max|ref|``) quarantines the chain from the
first differing block, counts, logs and raises the alert. Image prompts are skipped."""

from __future__ import annotations

import logging
import random
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from ... import codec
from ...cache import PromptCache
from ...meta import BlockMeta, ExtraKeySpan, Namespace
from . import adapters
from .payload import MLXPayloadAdapter

logger = logging.getLogger(__name__)

TOLERANCE = {"float32": (1e-3, 1e-3), "16bit": (3e-2, 3e-2)}


@dataclass
class _Job:
    ns: Namespace
    tokens: np.ndarray  # the hit's restored prefix (uint32)
    block: BlockMeta | None = None
    chain: list[BlockMeta] = field(default_factory=list)
    caches: list[Any] | None = None
    pos: int = 0
    logits: Any = None


class ShadowVerifier:
    def __init__(self, model: Any, cache: PromptCache, *, fraction: float, chunk_tokens: int = 256,
                 max_pending: int = 8, seed: int | None = None, alert_window: int = 50,
                 tolerance: dict[str, tuple[float, float]] | None = None,
                 busy: Callable[[], bool] | None = None) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"shadow verification fraction must be in [0, 1], got {fraction}")
        self.model, self.cache = model, cache
        self.fraction = fraction
        self.chunk_tokens = max(1, chunk_tokens)
        self.tolerance = dict(TOLERANCE, **(tolerance or {}))
        self.adapter = MLXPayloadAdapter()
        self._rng = random.Random(seed)
        self._queue: deque[_Job] = deque(maxlen=max_pending)
        self._job: _Job | None = None
        self._lock = threading.Lock()
        self.alert_window = alert_window
        self._clean_since_mismatch = alert_window
        self.counts = {"sampled": 0, "checked": 0, "matched": 0, "mismatches": 0,
                       "quarantined_blocks": 0, "skipped": 0, "dropped": 0, "chunks": 0, "deferred": 0}
        self.last_mismatch: dict[str, Any] | None = None
        # True while the engine has requests: step() then does nothing
        self.busy = busy

    def evicted(self, meta: BlockMeta) -> None:
        return None

    def acquired(self, req: Any, ns: Namespace, spans: Sequence[ExtraKeySpan],
                 hit_tokens: int, miss: Any) -> None:
        if hit_tokens <= 0 or self.fraction <= 0 or self._rng.random() >= self.fraction:
            return
        with self._lock:
            self.counts["sampled"] += 1
            if spans:
                self.counts["skipped"] += 1
                return
            if len(self._queue) == self._queue.maxlen:
                self.counts["dropped"] += 1
            self._queue.append(_Job(ns, np.array(req.arr[:hit_tokens], dtype=np.uint32)))

    @property
    def pending(self) -> bool:
        with self._lock:
            return self._job is not None or bool(self._queue)

    @property
    def alerting(self) -> bool:
        return self._clean_since_mismatch < self.alert_window

    def step(self) -> bool:
        """Advance the current job by one chunk; False: nothing to do, or the engine is busy."""
        if self.busy is not None and self.busy():
            self.counts["deferred"] += 1
            return False
        with self._lock:
            if self._job is None:
                if not self._queue:
                    return False
                self._job = self._queue.popleft()
            job = self._job
        try:
            done = self._advance(job)
        except Exception:
            logger.exception("shadow verification failed (not counted as a mismatch)")
            done = True
            self.counts["skipped"] += 1
        if done:
            with self._lock:
                self._job = None
        return True

    def _advance(self, job: _Job) -> bool:
        if job.block is None and not self._locate(job):
            self.counts["skipped"] += 1
            return True
        block = job.block
        if block is None:
            return True
        seq = np.concatenate([job.tokens[:block.start],
                              np.asarray(block.token_ids, dtype=np.uint32)])
        if job.caches is None:
            job.caches = list(make_prompt_cache(self.model))
        end = min(block.end, job.pos + self.chunk_tokens)
        logits = self.model(mx.array(seq[job.pos:end])[None], cache=job.caches)
        job.logits = logits[0, -1]
        mx.eval(job.logits, *[a for _, a in adapters.state_arrays(job.caches)])
        job.pos = end
        self.counts["chunks"] += 1
        if end < block.end:
            return False
        self._compare(job, seq)
        return True

    def _locate(self, job: _Job) -> bool:
        """The last block the hit restored, and its chain, as the cache holds them now."""
        m = self.cache.lookup(job.tokens, job.ns)
        chain = [b for b in m.blocks if b.start < len(job.tokens)]
        if not chain:
            return False
        job.chain, job.block = chain, chain[-1]
        return True

    def _stored(self, meta: BlockMeta, ns: Namespace) -> Mapping[str, mx.array] | None:
        rec = self.cache.read_block(meta.block_hash, ns)
        if rec is None:
            return None
        dec = codec.decode(rec[1])
        payload: Mapping[str, mx.array] = self.adapter.from_buffer(dec.buffer, dec.desc.layout)
        return payload

    def _tol(self, a: mx.array) -> tuple[float, float]:
        return self.tolerance["float32" if a.dtype == mx.float32 else "16bit"]

    def _close(self, ref: mx.array, got: mx.array) -> tuple[bool, float]:
        r, g = ref.astype(mx.float32), got.astype(mx.float32)
        atol, rtol = self._tol(ref)
        err = float(np.array(mx.max(mx.abs(r - g))))
        scale = float(np.array(mx.max(mx.abs(r))))
        return err <= atol + rtol * scale, err

    def _diff(self, fresh: Mapping[str, mx.array], stored: Mapping[str, mx.array],
              with_state: bool) -> list[str]:
        problems: list[str] = []
        keys = {k for k in stored if with_state or ".s." not in k}
        if set(fresh) != keys:
            problems.append(f"payload arrays differ: {sorted(set(fresh) ^ keys)[:4]}")
        for key in sorted(set(fresh) & keys):
            f, s = fresh[key], stored[key]
            if f.shape != s.shape:
                problems.append(f"{key}: shape {tuple(s.shape)} != {tuple(f.shape)}")
            elif mx.issubdtype(f.dtype, mx.floating):
                ok, err = self._close(f, s)
                if not ok:
                    problems.append(f"{key}: max |diff| {err:.3g}")
        return problems

    def _compare(self, job: _Job, seq: np.ndarray) -> None:
        """Compare each block, then the logits, with the fresh caches; the culprit is the first
        differing block (else the last)."""
        last = job.block
        if last is None or job.caches is None:
            return
        pairs: list[tuple[BlockMeta, Mapping[str, mx.array]]] = []
        for meta in job.chain:
            p = self._stored(meta, job.ns)
            if p is None:  # evicted meanwhile: nothing to judge
                self.counts["skipped"] += 1
                return
            pairs.append((meta, p))
        self.counts["checked"] += 1
        culprit: BlockMeta | None = None
        problems: list[str] = []
        for meta, stored in pairs:
            is_last = meta.block_hash == last.block_hash
            with_state = is_last and any(".s." in k for k in stored)
            try:
                fresh = adapters.extract_block(job.caches, meta.start, meta.end,
                                               snapshot=with_state)
            except Exception:  # e.g. outside a sliding window: not comparable here
                continue
            problems = self._diff(fresh, stored, with_state)
            if problems:
                culprit = meta
                break
        if culprit is None:
            restored = adapters.restore(self.model, pairs, last.end - 1, reserve=1)
            out = self.model(mx.array(seq[last.end - 1:last.end])[None], cache=restored)
            ok, err = self._close(job.logits, out[0, -1])
            if not ok:
                culprit, problems = last, [f"next-token logits: max |diff| {err:.3g}"]
        if culprit is None:
            self.counts["matched"] += 1
            self._clean_since_mismatch += 1
            return
        self.counts["mismatches"] += 1
        self._clean_since_mismatch = 0
        n = int(self.cache.quarantine_chain(culprit.block_hash, job.ns))
        self.counts["quarantined_blocks"] += n
        self.last_mismatch = {"block": culprit.block_hash.hex(), "start": culprit.start,
                              "end": culprit.end, "tenant": job.ns.tenant,
                              "problems": problems[:8], "quarantined_blocks": n}
        logger.error("shadow verification: block %s [%d, %d) of tenant %s does not match its "
                     "recomputation (%s); quarantined %d blocks from it on",
                     culprit.block_hash.hex()[:16], culprit.start, culprit.end, job.ns.tenant,
                     "; ".join(problems[:4]), n)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            pending = len(self._queue) + (self._job is not None)
        return {"fraction": self.fraction, **self.counts, "pending": pending,
                "alerting": self.alerting, "last_mismatch": self.last_mismatch}
