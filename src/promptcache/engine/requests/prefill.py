"""Batched prefill: requests that prefill at the same step share one forward per chunk.
``PrefillBatch`` holds the rows being prefilled together and their batch caches
(mlx-lm's ``BatchKVCache``, one per layer: each row's restored prefix left-padded to
the longest when it joins, as mlx-lm's ``BatchGenerator`` merges the caches it is
handed). One ``step()``:

1. every row takes its next chunk, exactly the one it would take alone: from its
   position to the next absolute multiple of the chunk size, or to the prompt's end
   (so every mid-prefill save lands on the same block boundary as alone). A row
   whose chunk reaches the prompt's end holds its last token back;
2. the chunks are right-padded to the longest and run in ONE forward
   (``prepare(right_padding)`` / ``finalize()``: the pad tokens' KV is rolled to the
   left and masked from then on, as in mlx-lm's ``PromptProcessingBatch.prompt``).
   Only the caches are evaluated: the lm head over the chunk's positions never runs;
3. rows still inside their prompt store their new blocks (save point 1, read from
   lazy views of their row: only the new blocks are sliced and copied);
4. rows at the prompt's end leave the batch: their rows are merged (copied) into a
   new batch cache, their held-back last tokens run in one ``[rows, 1]`` forward
   that gives each its first-token logits; each samples and emits its first token,
   then stores the whole prompt (save point 2) from its row of that cache, which
   then joins the decode batch as it is.

Sliding windows (``BatchRotatingKVCache``): before the forward, a row whose chunk
would push whole unsaved blocks out of a window stores them first, from its row
(``Request.save_before_slide``, as alone), and again before its last token slides the
window; a step whose longest chunk is one token beside a row with none is two wide
(``mlx_compat.prefill_width``). Array / SSM states: mlx-lm's recurrent layers read the
rows' lengths (``prepare(lengths=...)``) so a pad token leaves a row's state as it is.

Requests whose caches mlx-lm batches exactly (``mlx_compat.can_batch_prefill``: plain
and MLA KV, windows without ``keep``, the array states of the model modules that honour
the padding, ``CacheList``s of those) and that have no image embeddings are batched;
the rest (quantized KV, windows with ``keep``, nemotron_h's Mamba2 state) prefill on
the per-request path (``Request.prefill_chunk``). The scheduler bounds a step by rows
(``prefill_batch_size``) and tokens (``prefill_batch_tokens``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from .. import mlx_compat
from ..payload import adapters
from .request import Request

logger = logging.getLogger(__name__)


# fp32 [rows, heads, chunk, context] tensors one attention layer of a batched chunk
# holds at once (scores, the mask applied to them, the probabilities), measured:
# 8 rows x 4 heads x 256 x 1.6k tokens took 116 MB over the KV (mx.get_peak_memory)
WORKSPACE_TENSORS = 3


def attention_heads(model: Any) -> int:
    """The query heads of the model's attention layers (an upper bound for hybrids),
    from its config (``args.num_attention_heads``); 1 if it does not say."""
    args = getattr(model, "args", None)
    for name in ("num_attention_heads", "n_heads"):
        heads = getattr(args, name, None)
        if isinstance(heads, int) and heads > 0:
            return heads
    return 1


def workspace_bytes(rows: int, chunk: int, context: int, heads: int) -> int:
    """Peak bytes a batched prefill forward adds over the KV it holds: the attention of
    ``rows`` right-padded chunks of ``chunk`` tokens over ``context`` left-padded
    positions, in float32."""
    return WORKSPACE_TENSORS * 4 * rows * heads * chunk * context


@dataclass
class Prefilled:
    """Rows whose prompt ended this step, still running: ``cache`` holds exactly their
    rows (row ``i`` = ``reqs[i]``), each ``reqs[i].output[-1]`` is its first token."""

    reqs: list[Request]
    cache: list[Any]


class PrefillBatch:
    """The rows prefilling together and their batch caches."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.rows: list[Request] = []
        self.cache: list[Any] = []

    def __len__(self) -> int:
        return len(self.rows)

    def nbytes(self) -> int:
        return mlx_compat.batch_nbytes(self.cache) if self.rows else 0

    def step_tokens(self) -> int:
        """Tokens the rows feed at the next step (each one chunk at most)."""
        return sum(r.chunk_end() - r.pos for r in self.rows)

    # ------------------------------------------------------------------ membership

    def join(self, reqs: list[Request]) -> None:
        """Add started requests (their private caches, plain KV, hold ``pos`` tokens:
        a restored prefix or nothing). Their caches are copied into the batch."""
        if not reqs:
            return
        merged = mlx_compat.merge_requests([r.caches for r in reqs])
        if not self.rows:
            self.cache = merged
        else:
            for mine, theirs in zip(self.cache, merged, strict=True):
                mlx_compat.extend(mine, theirs)
        for r in reqs:
            r.caches = []
            self.rows.append(r)

    def _remove(self, drop: set[int]) -> None:
        keep = [i for i in range(len(self.rows)) if i not in drop]
        if not keep:
            self.rows, self.cache = [], []
            return
        if len(keep) < len(self.rows):
            for c in self.cache:
                mlx_compat.filter_rows(c, keep)
            self.rows = [self.rows[i] for i in keep]

    def drop_cancelled(self) -> None:
        """Rows whose client went away end without a save (as on the per-request path:
        what they prefilled so far was stored at the chunk boundaries)."""
        gone = {i for i, r in enumerate(self.rows) if r.cancelled}
        for i in sorted(gone):
            self.rows[i].finish("cancelled", None)
        if gone:
            self._remove(gone)

    def fail_all(self, error: str) -> None:
        for r in self.rows:
            if not r.done:
                r.fail(error)
        self.rows, self.cache = [], []

    # ------------------------------------------------------------------ the step

    def step(self) -> Prefilled | None:
        """One chunk of every row in one forward; returns the rows whose prompt ended
        and that decode next (None if none)."""
        rows = self.rows
        if not rows:
            return None
        t = time.perf_counter()
        ends = [r.chunk_end() for r in rows]
        # a row at its prompt's end holds its last token back (fed in _first_tokens)
        lengths = [e - r.pos - (1 if e >= r.n_prompt else 0) for r, e in zip(rows, ends, strict=True)]
        width = mlx_compat.prefill_width(self.cache, lengths)
        if width > 0:
            for i, (r, n) in enumerate(zip(rows, lengths, strict=True)):
                if n > 0 and r.slide_save_due(r.pos):
                    # blocks this forward pushes out of a window are stored first
                    r.save_before_slide(r.pos, n, mlx_compat.row_caches(self.cache, i))
            inputs = np.zeros((len(rows), width), dtype=np.uint32)
            for i, (r, n) in enumerate(zip(rows, lengths, strict=True)):
                inputs[i, :n] = r.seq[r.pos : r.pos + n]
            t_fwd = time.perf_counter()
            mlx_compat.prepare_right_padded(self.cache, lengths, width)
            self.model(mx.array(inputs), cache=self.cache)  # logits never evaluated
            mlx_compat.finalize_right_padded(self.cache)
            mlx_compat.trim_common_padding(self.cache)
            mx.eval(*[a for _, a in adapters.state_arrays(self.cache)])
            rows[0].ctx.timed_prefill([(r.pos, n) for r, n in zip(rows, lengths, strict=True)],
                                      time.perf_counter() - t_fwd)
        c = rows[0].ctx.counters
        c.prefill_batches += 1
        c.max_prefill_batch = max(c.max_prefill_batch, len(rows))
        elapsed = time.perf_counter() - t
        ending: list[int] = []
        for i, (r, e) in enumerate(zip(rows, ends, strict=True)):
            r.prefill_s += elapsed
            if e >= r.n_prompt:
                r.pos += lengths[i]
                ending.append(i)
            else:
                views = mlx_compat.row_caches(self.cache, i)
                r.chunk_done(e, views)  # save point 1 from this row
        if not ending:
            return None
        views = [mlx_compat.row_caches(self.cache, i) for i in ending]
        for i, v in zip(ending, views, strict=True):
            r = rows[i]
            if r.slide_save_due(r.pos):  # the last token alone slides a window
                r.save_before_slide(r.pos, 1, v)
        done = self._first_tokens([rows[i] for i in ending], mlx_compat.merge_requests(views))
        self._remove(set(ending))
        return done

    def _first_tokens(self, reqs: list[Request], cache: list[Any]) -> Prefilled | None:
        """The prompts' last tokens in one forward over ``cache`` (their rows), the first
        token of each, then the end-of-prefill saves; the rows that decode next."""
        t = time.perf_counter()
        last = mx.array([[int(r.seq[r.n_prompt - 1])] for r in reqs], dtype=mx.uint32)
        logits = self.model(last, cache=cache)[:, -1, :]
        mx.eval(logits, *[a for _, a in adapters.state_arrays(cache)])
        elapsed = time.perf_counter() - t
        reasons = []
        for i, r in enumerate(reqs):
            r.prefill_s += elapsed
            r.chunk_done(r.n_prompt)
            # every first token goes out before any end-of-prefill save
            reasons.append(r.first_token(logits[i]))
        for i, (r, reason) in enumerate(zip(reqs, reasons, strict=True)):
            r.end_prefill(reason, mlx_compat.row_caches(cache, i))
        alive = [i for i, r in enumerate(reqs) if not r.done]
        if not alive:
            return None
        if len(alive) < len(reqs):
            for c in cache:
                mlx_compat.filter_rows(c, alive)
        return Prefilled([reqs[i] for i in alive], cache)
