"""mlx-lm's model modules and the tokenizer inside its wrapper (model classes, offsets);
``LanguageModel`` and ``Tokenizer``, the engine's types for mlx-lm's untyped objects."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import mlx.core as mx
    from transformers import PreTrainedTokenizerFast


class LanguageModel(Protocol):
    """An mlx-lm model (or a VLM's text model): logits of ``inputs`` over its caches."""
    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array: ...


class Tokenizer(Protocol):
    """mlx-lm's ``TokenizerWrapper`` as the engine uses it: text <-> token ids."""
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


def model_classes(model_type: str) -> tuple[Any, Any]:
    """``(Model, ModelArgs)`` of an mlx-lm architecture (its module imported directly)."""
    if not model_type.replace("_", "").isalnum():
        raise ValueError(f"invalid model_type {model_type!r}")
    try:
        module = importlib.import_module(f"mlx_lm.models.{model_type}")
    except ImportError as e:
        raise ValueError(f"mlx-lm has no model type {model_type!r}") from e
    return module.Model, module.ModelArgs


def fast_tokenizer(tokenizer: object) -> PreTrainedTokenizerFast | None:
    """The HF fast tokenizer inside mlx-lm's ``TokenizerWrapper``; None for anything else."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    if not isinstance(tokenizer, TokenizerWrapper):
        return None
    hf = tokenizer._tokenizer
    return hf if isinstance(hf, PreTrainedTokenizerFast) else None


def encode_with_offsets(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]] | None:
    """Token ids of ``text`` (no specials) and their character spans; None without offsets."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    if not callable(hf) or not getattr(hf, "is_fast", False):
        return None
    enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = [int(t) for t in enc["input_ids"]]
    offsets = [(int(a), int(b)) for a, b in enc["offset_mapping"]]
    return ids, offsets
