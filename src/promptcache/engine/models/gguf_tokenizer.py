"""Rebuild a HF ``tokenizer.json`` from GGUF metadata (``gpt2`` byte-level BPE: SmolLM2, Qwen)."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# GGUF "tokenizer.ggml.pre" names whose pre-tokenization splits digits one by one (llama.cpp)
_INDIVIDUAL_DIGITS = {"smollm", "starcoder", "refact"}
_GPT2_REGEX = {"gpt2", "default", "smollm", "starcoder", "refact", None}


def _as_int(value: Any) -> int | None:
    if value is None:
        return None
    if hasattr(value, "item"):
        value = value.item()
    return int(value)


def _as_bool(value: Any, default: bool) -> bool:
    if value is None:
        return default
    if hasattr(value, "item"):
        value = value.item()
    return bool(value)


def build_tokenizer(meta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(tokenizer.json text, tokenizer_config.json dict)``; ValueError for an unsupported kind."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
    pre = meta.get("tokenizer.ggml.pre")
    if pre not in _GPT2_REGEX:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges_raw: list[str] = list(meta.get("tokenizer.ggml.merges") or [])
    types_arr = meta.get("tokenizer.ggml.token_type")
    types: list[int] = (
        [int(t) for t in types_arr.tolist()] if types_arr is not None else [1] * len(tokens)
    )
    if len(types) != len(tokens):
        raise ValueError(f"GGUF has {len(tokens)} tokens but {len(types)} token types")

    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF vocabulary has duplicate tokens")
    merges: list[tuple[str, str]] = []
    for m in merges_raw:
        left, sep, right = m.partition(" ")
        if not sep:
            raise ValueError(f"malformed GGUF merge {m!r}")
        merges.append((left, right))

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _INDIVIDUAL_DIGITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [
        tokens[i] for i, t in enumerate(types) if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
    ]
    tok.add_special_tokens(
        [AddedToken(s, special=True, normalized=False, lstrip=False, rstrip=False) for s in specials]
    )
    for s in specials:  # added tokens must keep their GGUF ids
        if tok.token_to_id(s) != vocab[s]:
            raise ValueError(f"special token {s!r} changed id while rebuilding the tokenizer")

    def name(key: str) -> str | None:
        i = _as_int(meta.get(key))
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {
            str(vocab[s]): {
                "content": s, "lstrip": False, "normalized": False, "rstrip": False,
                "single_word": False, "special": True,
            }
            for s in specials
        },
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "add_bos_token": _as_bool(meta.get("tokenizer.ggml.add_bos_token"), False),
        "add_eos_token": _as_bool(meta.get("tokenizer.ggml.add_eos_token"), False),
        "clean_up_tokenization_spaces": False,
        "additional_special_tokens": specials,
    }
    if _as_int(meta.get("llama.context_length")) is not None:
        config["model_max_length"] = _as_int(meta.get("llama.context_length"))
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        config["chat_template"] = template
    logger.debug("rebuilt tokenizer: %d tokens, %d merges, %d special", len(tokens), len(merges), len(specials))
    return str(tok.to_str()), config
