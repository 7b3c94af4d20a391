"""The one place that knows mlx-lm's internal layout (tested against mlx-lm 0.32.x).

Anything here may change between mlx-lm releases; pyproject pins the range.
What is used:
- model classes by ``model_type`` (``mlx_lm.models.<type>.Model / ModelArgs``);
- the Hugging Face tokenizer inside mlx-lm's ``TokenizerWrapper`` (``_tokenizer``), for
  one tokenization with character offsets and to tell a fast one (``fast_tokenizer``:
  constrained decoding's bridge reads its ``backend_tokenizer``);
- the batch caches of ``mlx_lm.models.cache`` (``BatchKVCache``,
  ``BatchRotatingKVCache``, ``ArraysCache``, ``CacheList``): their public ``merge`` /
  ``extend`` / ``filter`` / ``extract`` / ``prepare`` / ``finalize``, plus the private
  fields ``left_padding`` / ``_idx`` / ``offset`` / ``keys`` / ``values`` of
  ``BatchKVCache`` to read one row's KV without copying the whole row
  (``row_caches``) and to drop the padding every row of a prefill batch has in common
  (``trim_common_padding``).
- batched prefill of right-padded chunks (``prepare(lengths=..., right_padding=...)``
  before the forward, ``finalize()`` after it: the pad tokens' KV is rolled to the left
  and counted as left padding; recurrent layers read the lengths), as mlx-lm's own
  ``PromptProcessingBatch.prompt`` does; which model modules' recurrent layers honour
  those lengths (``RIGHT_PADDED_STATE_MODULES``, read from the model's module name).
- the rule by which ``RotatingKVCache.update_and_fetch`` drops tokens from a sliding
  window (``window_floor_after``), read from its public ``state``.
- speculative decoding's repair of a verify forward: ``BatchRotatingKVCache``'s
  ``_temporal_order()`` / ``_idx`` / ``keys`` / ``values`` / ``offset`` /
  ``left_padding`` (``before_verify``, ``drop_row_tails``) and ``ArraysCache.cache``
  (``restore_before_verify``); ``dynamic_roll`` of ``mlx_lm.models.cache``; after a
  hybrid batch's refeed, ``BatchKVCache._right_padding`` (read, and cleared when the
  rows' first positions are moved into the pad tails instead: ``finalize_refeed``).

Every use of mlx-lm's private APIs stays behind this package; callers import from
``mlx_compat`` itself (re-exported below), not from its modules:
``models`` (model classes, the tokenizer's offsets, its fast tokenizer),
``batch_caches`` (merging, padding and reading rows of batch caches), ``speculation``
(a verify forward's repair) and ``windows`` (what a sliding window dropped).
"""

from __future__ import annotations

from .batch_caches import (
    RIGHT_PADDED_STATE_MODULES,
    RowMoves,
    batch_nbytes,
    can_batch,
    can_batch_prefill,
    copy_array,
    copy_row,
    extend,
    filter_rows,
    finalize_right_padded,
    merge,
    merge_requests,
    model_module,
    prefill_width,
    prepare_right_padded,
    row_caches,
    ssm_states,
    trim_common_padding,
)
from .models import (
    encode_with_offsets,
    fast_tokenizer,
    model_classes,
)
from .speculation import (
    before_verify,
    drop_row_tails,
    finalize_refeed,
    restore_before_verify,
    speculation_kind,
    states_take_lengths,
)
from .windows import (
    window_floor,
    window_floor_after,
)

__all__ = [
    "RIGHT_PADDED_STATE_MODULES",
    "RowMoves",
    "batch_nbytes",
    "before_verify",
    "can_batch",
    "can_batch_prefill",
    "copy_array",
    "copy_row",
    "drop_row_tails",
    "finalize_refeed",
    "encode_with_offsets",
    "extend",
    "fast_tokenizer",
    "filter_rows",
    "finalize_right_padded",
    "merge",
    "merge_requests",
    "model_classes",
    "model_module",
    "prefill_width",
    "prepare_right_padded",
    "restore_before_verify",
    "row_caches",
    "speculation_kind",
    "ssm_states",
    "states_take_lengths",
    "trim_common_padding",
    "window_floor",
    "window_floor_after",
]
