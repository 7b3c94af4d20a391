"""The one place that knows mlx-lm's internal layout (tested against mlx-lm 0.32.x).

Anything here may change between mlx-lm releases; pyproject pins the range.
What is used:
- model classes by ``model_type`` (``mlx_lm.models.<type>.Model / ModelArgs``);
- the Hugging Face tokenizer inside mlx-lm's ``TokenizerWrapper`` (``_tokenizer``), for
  one tokenization with character offsets;
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
  (``restore_before_verify``); ``dynamic_roll`` of ``mlx_lm.models.cache``.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    CacheList,
    KVCache,
    RotatingKVCache,
    dynamic_roll,
)


def model_classes(model_type: str) -> tuple[Any, Any]:
    """``(Model, ModelArgs)`` of an mlx-lm architecture, e.g. ``"llama"``.

    Every module in ``mlx_lm.models`` defines these two names; we import the module
    directly instead of calling mlx-lm's private class lookup.
    """
    if not model_type.replace("_", "").isalnum():
        raise ValueError(f"invalid model_type {model_type!r}")
    try:
        module = importlib.import_module(f"mlx_lm.models.{model_type}")
    except ImportError as e:
        raise ValueError(f"mlx-lm has no model type {model_type!r}") from e
    return module.Model, module.ModelArgs


# ---------------------------------------------------------------- tokenizer


def encode_with_offsets(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]] | None:
    """Token ids of ``text`` (no special tokens added) and each token's character span,
    from one call of the Hugging Face fast tokenizer; None if it has no offsets."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    if not callable(hf) or not getattr(hf, "is_fast", False):
        return None
    enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = [int(t) for t in enc["input_ids"]]
    offsets = [(int(a), int(b)) for a, b in enc["offset_mapping"]]
    return ids, offsets


# ---------------------------------------------------------------- batch caches


def _leaves(caches: Sequence[Any]) -> list[Any]:
    out: list[Any] = []
    for c in caches:
        if isinstance(c, CacheList):
            out.extend(_leaves(list(c.caches)))
        else:
            out.append(c)
    return out


def can_batch(caches: Sequence[Any]) -> bool:
    """True if mlx-lm can merge these per-request caches into batch caches: plain KV,
    sliding-window KV without kept tokens (``BatchRotatingKVCache`` has no ``keep``),
    SSM / arrays state, and lists of those. Quantized KV and others cannot."""
    for c in _leaves(caches):
        if type(c) is KVCache or type(c) is ArraysCache:
            continue
        if type(c) is RotatingKVCache and c.keep == 0:
            continue
        return False
    return True


# Model modules whose recurrent layers honour ``ArraysCache.lengths`` in a right-padded
# forward (mlx-lm 0.32: the conv state is taken at each row's last real token and the
# scan / delta rule leaves the state untouched at pad positions), so a row's state after
# a padded chunk equals its state alone. Checked family by family against each request
# prefilled alone (tests/engine/test_batch_prefill_kinds.py). Not here: ``nemotron_h``,
# whose Mamba2 scan gets the mask but not the lengths (it takes the decay at the padded
# last position, 0: a padded row's SSM state keeps none of the chunk; see that test and
# BENCHMARKS.md "Batched prefill by cache kind"), and the recurrent models that take
# neither (mamba, jamba, rwkv7, recurrent_gemma, ...).
RIGHT_PADDED_STATE_MODULES = frozenset({
    "qwen3_5", "qwen3_5_moe", "qwen3_next", "falcon_h1", "kimi_linear",
})


def model_module(model: Any) -> str:
    """The mlx-lm module that implements ``model`` (``"qwen3_next"``)."""
    return str(type(model).__module__).rsplit(".", 1)[-1]


def can_batch_prefill(caches: Sequence[Any], model: Any = None) -> bool:
    """True if these per-request caches can be prefilled in one forward with others'
    right-padded chunks exactly as alone: plain KV (MLA included: its K and V widths
    differ but it is a plain ``KVCache``), sliding windows without kept tokens
    (``BatchRotatingKVCache`` rolls a row's pad tokens out of its window), array / SSM
    states of ``model``'s module when it honours the padding
    (``RIGHT_PADDED_STATE_MODULES``), and ``CacheList``s of those. Quantized KV and
    windows with ``keep`` prefill on the per-request path."""
    if not caches:
        return False
    states_ok = model is not None and model_module(model) in RIGHT_PADDED_STATE_MODULES
    for c in _leaves(caches):
        if type(c) is KVCache:
            continue
        if type(c) is RotatingKVCache and c.keep == 0:
            continue
        if type(c) is ArraysCache and states_ok:
            continue
        return False
    return True


def prefill_width(batch: Sequence[Any], lengths: Sequence[int]) -> int:
    """The width of a right-padded prefill forward of chunks of ``lengths`` tokens.

    A one-token forward writes a sliding window in place (no room for a pad token:
    ``BatchRotatingKVCache`` refuses it once padding is prepared), so when the longest
    chunk is one token and some row has none, the forward is two wide (each row's pad
    is then rolled out of its window as any other)."""
    width = max(lengths)
    if width == 1 and min(lengths) == 0 and any(
            isinstance(c, BatchRotatingKVCache) for c in _leaves(batch)):
        return 2
    return width


def merge_requests(caches: Sequence[Sequence[Any]]) -> list[Any]:
    """Per-layer batch caches of several requests' per-layer caches (copies: rows
    are left-padded to the longest)."""
    return [merge([c[layer] for c in caches]) for layer in range(len(caches[0]))]


def prepare_right_padded(batch: Sequence[Any], lengths: Sequence[int],
                         width: int | None = None) -> None:
    """Before a forward of right-padded inputs: row ``i`` has ``lengths[i]`` real tokens
    of ``width`` (default ``max(lengths)``)."""
    width = max(lengths) if width is None else width
    right = [width - n for n in lengths]
    for c in batch:
        c.prepare(lengths=list(lengths), right_padding=right)


def finalize_right_padded(batch: Sequence[Any]) -> None:
    """After that forward: the pad tokens' KV moves to the left (left padding)."""
    for c in batch:
        c.finalize()


def trim_common_padding(batch: Sequence[Any]) -> None:
    """Drop the left padding all rows share (views: nothing is copied). Prefilling rows
    gain left padding whenever a chunk is shorter than the longest of its step."""
    kv = [c for c in batch if isinstance(c, BatchKVCache) and c.keys is not None]
    if not kv:
        return
    m = int(cast(int, mx.min(kv[0].left_padding).item()))  # the same in every layer
    if m <= 0:
        return
    for c in kv:
        c.keys = c.keys[..., m:, :]
        c.values = c.values[..., m:, :]
        c._idx -= m
        c.left_padding = c.left_padding - m


def copy_row(batch: Sequence[Any], idx: int) -> list[Any]:
    """Private per-layer caches of row ``idx`` with their own buffers (a request that
    leaves a prefill batch and waits for a decode row)."""
    out = row_caches(batch, idx)
    for c in _leaves(out):  # KV views (in a CacheList too); the rest are copies
        if isinstance(c, KVCache) and c.keys is not None:
            c.keys = copy_array(c.keys)
            c.values = copy_array(c.values)
    return out


def merge(caches: Sequence[Any]) -> Any:
    """One batch cache of a layer from the per-request caches of that layer."""
    return type(caches[0]).merge(list(caches))


def extend(batch: Any, other: Any) -> None:
    """Append the rows of ``other`` to ``batch`` (both batch caches of one layer)."""
    batch.extend(other)


def speculation_kind(batch: Sequence[Any]) -> str | None:
    """How a batch's caches take a verify forward's rejected positions back:

    - ``"kv"``: every leaf is a ``BatchKVCache`` or a ``BatchRotatingKVCache`` (plain
      KV, MLA, sliding windows): the rejected tail of each row is dropped
      (``drop_row_tails``);
    - ``"state"``: ``ArraysCache`` leaves (SSM / linear attention state, which absorbs
      every position fed) with ``BatchKVCache`` leaves: the states are put back as they
      were before the verify and the accepted tokens are fed again
      (``restore_before_verify`` + a right-padded forward);
    - None: anything else (quantized KV; array states next to sliding windows)."""
    leaves = _leaves(batch)
    if not leaves:
        return None
    kinds = {type(c) for c in leaves}
    if not kinds <= {BatchKVCache, BatchRotatingKVCache, ArraysCache}:
        return None
    if ArraysCache in kinds:
        return None if BatchRotatingKVCache in kinds else "state"
    return "kv"


# model types whose array-state layers honour ``ArraysCache.lengths`` in mlx-lm 0.32 (a
# right-padded position never reaches their conv or recurrent state). nemotron_h's
# Mamba2 masks the padding but passes no lengths to ``ssm_update``: the state after a
# right-padded chunk loses the real tokens. Each entry is checked by
# tests/engine/test_speculation_kinds.py (rows of different lengths fed again).
_STATES_TAKE_LENGTHS = frozenset({"qwen3_5", "qwen3_5_moe", "qwen3_next", "falcon_h1",
                                  "kimi_linear"})


def states_take_lengths(model: Any) -> bool:
    """True if ``model``'s array states can be fed right-padded rows (``prepare(lengths)``)."""
    return getattr(model, "model_type", None) in _STATES_TAKE_LENGTHS


def before_verify(batch: Sequence[Any]) -> list[list[Any]] | None:
    """Before a verify forward (several positions per row): sliding windows are put in
    temporal order (what ``BatchRotatingKVCache``'s concatenating update does first
    anyway; done before the model builds its mask from the cache, so that the mask and
    the update agree on the window's first column), and the array states are returned
    (references: the forward replaces them, so these stay the pre-verify state; None
    when there are none)."""
    for c in _leaves(batch):
        if isinstance(c, BatchRotatingKVCache) and c.keys is not None:
            c._temporal_order()
    states = ssm_states(batch)
    return states if states else None


def drop_row_tails(batch: Sequence[Any], counts: Sequence[int]) -> None:
    """Drop the last ``counts[i]`` positions of row ``i`` (rejected draft tokens and
    right padding) after a verify forward: what all rows drop is trimmed; the rest of a
    row's tail becomes its left padding (mlx-lm's right-padding path: the tail is rolled
    to the left, where the mask excludes it).

    Sliding windows (``BatchRotatingKVCache``) after the concatenating update of a
    verify forward hold, in temporal order, the last ``max_size - 1`` tokens from
    before it and every position it fed. Their common tail is trimmed AND sliced off
    the buffer (``trim`` alone leaves it in the buffer, where the next single-token
    update would keep it in the window): the state is then the one a forward of only
    the kept positions would have left, and the next single-token update keeps the
    last ``max_size`` tokens of each row, as decoding one token at a time does."""
    leaves = _leaves(batch)
    common = min(counts)
    for c in leaves:
        if common > 0:
            c.trim(common)
        if isinstance(c, BatchRotatingKVCache) and c.keys is not None \
                and c.keys.shape[2] > c._idx:
            c.keys = c.keys[..., : c._idx, :]
            c.values = c.values[..., : c._idx, :]
    rest = [n - common for n in counts]
    if not any(rest):
        return
    for c in leaves:
        if isinstance(c, BatchRotatingKVCache):
            shift = mx.array(rest)
            c.keys = dynamic_roll(c.keys, shift[:, None], axis=2)
            c.values = dynamic_roll(c.values, shift[:, None], axis=2)
            c.offset = c.offset - shift
            c.left_padding = c.left_padding + shift
        else:
            c.prepare(right_padding=rest)
            c.finalize()


def restore_before_verify(batch: Sequence[Any], states: Sequence[Sequence[Any]],
                          width: int) -> None:
    """Undo a verify forward of ``width`` positions on a ``"state"`` batch: array states
    back to ``states`` (``before_verify``), KV leaves trimmed by ``width``."""
    it = iter(states)
    for c in _leaves(batch):
        if isinstance(c, ArraysCache):
            c.cache = list(next(it))
        else:
            c.trim(width)


def filter_rows(batch: Any, keep: Sequence[int]) -> None:
    batch.filter(list(keep))


def _row_kv(c: BatchKVCache, idx: int, pads: list[int]) -> KVCache:
    """A KVCache whose arrays are lazy views of row ``idx`` (nothing copied): the
    caller slices the blocks it needs and copies those."""
    pad = pads[idx]
    out = KVCache()
    end = int(c._idx)
    out.keys = c.keys[idx : idx + 1, :, pad:end, :]
    out.values = c.values[idx : idx + 1, :, pad:end, :]
    out.offset = end - pad
    return out


def copy_array(x: mx.array) -> mx.array:
    """A copy with its own buffer (``mx.contiguous`` returns a contiguous slice as is,
    sharing -- and pinning -- the whole source buffer)."""
    return mx.array(x)


def _row_arrays(c: ArraysCache, idx: int, states: list[Any] | None) -> ArraysCache:
    src = states if states is not None else c.cache
    out = ArraysCache(len(src))
    out.cache = [None if a is None else copy_array(a[idx : idx + 1]) for a in src]
    return out


def row_caches(batch: Sequence[Any], idx: int, ssm_states: list[list[Any]] | None = None
               ) -> list[Any]:
    """Per-layer cache objects of row ``idx`` of a batch, for reading blocks out of it.

    Plain KV layers are lazy views of the row (slice what you need and copy it);
    sliding-window layers are ``extract``-ed (a copy of one window); array states are
    copies, taken from ``ssm_states`` (the states before the last step, in leaf order)
    when given. Nothing returned shares a buffer that the batch later writes in place
    without also being a view the caller copies from.
    """
    states = iter(ssm_states) if ssm_states is not None else None
    pad_cache: dict[int, list[int]] = {}

    def one(c: Any) -> Any:
        if isinstance(c, CacheList):
            return CacheList(*(one(sub) for sub in c.caches))
        if isinstance(c, BatchKVCache):
            pads = pad_cache.get(id(c.left_padding))
            if pads is None:
                pads = [int(p) for p in c.left_padding.tolist()]
                pad_cache[id(c.left_padding)] = pads
            return _row_kv(c, idx, pads)
        if isinstance(c, BatchRotatingKVCache):
            return c.extract(idx)
        if isinstance(c, ArraysCache):
            return _row_arrays(c, idx, next(states) if states is not None else None)
        raise TypeError(f"not a batch cache: {type(c).__name__}")

    return [one(c) for c in batch]


def ssm_states(batch: Sequence[Any]) -> list[list[Any]]:
    """The current array states of every ArraysCache leaf (references: the batch
    replaces them with new arrays at each step, so these stay the pre-step state)."""
    return [list(c.cache) for c in _leaves(batch) if isinstance(c, ArraysCache)]


def batch_nbytes(batch: Sequence[Any]) -> int:
    """Bytes held by a batch's caches (padding included), from shapes only."""
    total = 0
    for c in _leaves(batch):
        if isinstance(c, ArraysCache):
            total += sum(int(a.nbytes) for a in c.cache if a is not None)
        elif getattr(c, "keys", None) is not None:
            total += int(c.keys.nbytes) + int(c.values.nbytes)
    return total


# ---------------------------------------------------------------- sliding windows


def _window_held(c: RotatingKVCache) -> int:
    """How many tokens a sliding window holds now (its ``keep`` tokens included)."""
    keys, _, offset, _keep, _max_size, idx = c.state
    if keys is None:
        return 0
    length = int(keys.shape[2])
    return length if idx == length or idx < offset else int(idx)


def window_floor(caches: Sequence[Any]) -> int:
    """The first token (past the ``keep`` tokens) that every sliding window of these
    per-request caches holds now: tokens from ``keep`` up to it are gone. 0 when no
    window dropped a token yet."""
    return max((_floor_now(c) for c in _leaves(caches) if isinstance(c, RotatingKVCache)),
               default=0)


def _floor_now(c: RotatingKVCache) -> int:
    held, offset = _window_held(c), int(c.offset)
    return offset - held + int(c.keep) if held < offset else 0


def window_floor_after(caches: Sequence[Any], n_new: int) -> int:
    """The first token (past the ``keep`` tokens) that every sliding window of these
    per-request caches still holds after ONE forward of ``n_new`` more tokens: tokens
    from ``keep`` up to it are gone then. 0 when no window drops a token.

    mlx-lm 0.32's ``RotatingKVCache.update_and_fetch``: a single token is written in
    place, after which the window holds its ``keep`` tokens and the last
    ``max_size - keep``; several tokens are concatenated, all of them kept, after the
    last ``max_size - 1 - keep`` tokens held before (so a long chunk keeps every one of
    its tokens until the next forward; a single token slides the window)."""
    if n_new < 1:
        raise ValueError(f"n_new must be >= 1, got {n_new}")
    floor = 0
    for c in _leaves(caches):
        if not isinstance(c, RotatingKVCache):
            continue
        keep, size, offset = int(c.keep), int(c.max_size), int(c.offset)
        if n_new == 1:
            lo = offset + 1 - (size - keep) if offset + 1 > size else 0
        else:
            lo = _floor_now(c)
            if _window_held(c) >= size:  # the concatenation trims the window first
                lo = max(lo, offset - (size - 1 - keep))
        if lo > keep:
            floor = max(floor, lo)
    return floor
