"""The one place that knows mlx-lm's internals (tested against 0.32.x; pyproject pins the range).

Private fields of the batch caches, ``TokenizerWrapper._tokenizer``, model modules and
``RotatingKVCache``'s window rule are used only here; callers import from ``mlx_compat`` itself."""

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
    LanguageModel,
    Tokenizer,
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
    "LanguageModel", "RIGHT_PADDED_STATE_MODULES", "RowMoves", "batch_nbytes", "before_verify",
    "can_batch", "can_batch_prefill", "copy_array", "copy_row", "drop_row_tails",
    "finalize_refeed", "encode_with_offsets", "extend", "fast_tokenizer", "filter_rows",
    "finalize_right_padded", "merge", "merge_requests", "model_classes", "model_module",
    "prefill_width", "prepare_right_padded", "restore_before_verify", "row_caches",
    "speculation_kind", "ssm_states", "states_take_lengths", "Tokenizer",
    "trim_common_padding", "window_floor", "window_floor_after",
]
