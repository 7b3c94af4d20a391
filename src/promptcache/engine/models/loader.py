"""Model loading (mlx-lm; mlx-vlm for vision models) and the model fingerprint. On CPU weights are
cast to float32 (half precision is slow or inexact there).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...fingerprint import model_fingerprint
from ..steps import Steps, no_steps

__all__ = ["ModelInfo", "context_length_from_config", "load_model", "model_fingerprint",
           "resolve_model_path"]

logger = logging.getLogger(__name__)

DEFAULT_CONTEXT_LENGTH = 4096
_CONTEXT_KEYS = (
    "max_position_embeddings",
    "max_sequence_length",
    "max_seq_len",
    "seq_length",
    "n_positions",
    "n_ctx",
    "model_max_length",
)
_ALLOW_PATTERNS = [
    "*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken",
    "tiktoken.model", "*.txt", "*.jsonl", "*.jinja",
]


@dataclass(frozen=True)
class ModelInfo:
    """What the engine needs to know about a loaded model."""

    model_id: str  # the repo id, or the folder name of a local model
    path: Path
    fingerprint: str
    model_type: str
    context_length: int
    dtype: str  # of the floating-point weights after loading, e.g. "float32"
    num_layers: int
    config: dict[str, Any] = field(repr=False, compare=False)


def resolve_model_path(path_or_repo: str | os.PathLike[str]) -> tuple[Path, str]:
    """``(folder, model_id)``: a local folder, or a HF repo id fetched into the HF cache."""
    text = os.fspath(path_or_repo).strip()
    if not text:
        raise ValueError("model path or repo id is empty")
    local = Path(text).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise ValueError(f"{local} is not a model folder (no config.json)")
        return local.resolve(), local.resolve().name
    if text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise ValueError(
            f"model {text!r} is neither an existing folder nor a Hugging Face repo id (owner/name)"
        )
    from huggingface_hub import snapshot_download

    logger.info("fetching %s from the Hugging Face hub (cached after the first time)", text)
    try:
        folder = Path(snapshot_download(text, allow_patterns=_ALLOW_PATTERNS))
    except Exception as e:  # whatever the hub client raises: offline, HTTP, connection
        logger.debug("downloading %s failed", text, exc_info=True)
        cause = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(f"model {text!r}: not a local folder, and it could not be downloaded "
                         f"from the Hugging Face hub ({type(e).__name__}: {cause})") from None
    return folder, text


def context_length_from_config(config: dict[str, Any], default: int = DEFAULT_CONTEXT_LENGTH) -> int:
    """The model's context length from its config (``text_config`` too), else ``default``."""
    for cfg in (config, config.get("text_config") or {}):
        for key in _CONTEXT_KEYS:
            value = cfg.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 10**8:
                return value
    return default


def load_model_or_vlm(path_or_repo: str | os.PathLike[str], *, float32_on_cpu: bool = True,
                      chat_template: str | None = None, lazy: bool = False,
                      steps: Steps = no_steps) -> tuple[Any, Any, ModelInfo, Any | None]:
    """``(model, tokenizer, info, vision_tower)`` through mlx-lm, or mlx-vlm for a VLM.

    A VLM family only mlx-lm has loads text-only (logged); ``lazy``: the weights are not read."""
    folder, model_id = resolve_model_path(path_or_repo)
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{folder}/config.json is unreadable: {e}") from None
    from . import vlm

    text_only = not vlm.is_vlm_config(config)
    if not text_only:
        model_type = str(config.get("model_type"))
        why = ""
        if model_type not in vlm.SUPPORTED_TYPES:
            why = (f"the vision path (mlx-vlm) does not support {model_type!r} yet "
                   f"(supported: {', '.join(vlm.SUPPORTED_TYPES)})")
        elif not (folder / "preprocessor_config.json").is_file():
            why = f"this {model_type!r} folder has no image processor (preprocessor_config.json)"
        text_only = bool(why) and _mlx_lm_has(model_type)
        if text_only:
            logger.info("%s ships a vision_config, but %s: loading it text-only through "
                        "mlx-lm (image inputs are refused)", model_id, why)
        else:
            logger.info("%s ships a vision_config of family %r: loading it with images "
                        "through mlx-vlm", model_id, model_type)
    if text_only:
        model, tokenizer, info = load_model(folder, float32_on_cpu=float32_on_cpu,
                                            chat_template=chat_template, lazy=lazy,
                                            steps=steps)
        return model, tokenizer, dataclasses.replace(info, model_id=model_id), None
    with steps("fingerprinting the weights"):
        fingerprint = model_fingerprint(folder)
    with steps("opening the model" if lazy else "loading the weights"):
        model, tokenizer, tower = vlm.load_vlm(folder, config, float32_on_cpu=float32_on_cpu,
                                               chat_template=chat_template, lazy=lazy)
    info = ModelInfo(
        model_id=model_id, path=folder, fingerprint=fingerprint,
        model_type=str(config.get("model_type", "unknown")),
        context_length=context_length_from_config(config), dtype=_dtype_of(model),
        num_layers=len(model.layers), config=config,
    )
    logger.info("loaded vision-language model %s (%s, %d layers, fingerprint %s)",
                info.model_id, info.model_type, info.num_layers, info.fingerprint[:12])
    return model, tokenizer, info, tower


def tokenizer_config(chat_template: str | None) -> dict[str, Any] | None:
    """What mlx-lm's tokenizer loader takes to replace the checkpoint's chat template."""
    return {"chat_template": chat_template} if chat_template is not None else None


def _mlx_lm_has(model_type: str) -> bool:
    """Whether mlx-lm has a model class for ``model_type`` (then it loads a VLM's text part)."""
    from ..mlx_compat import model_classes

    try:
        model_classes(model_type)
    except ValueError:
        return False
    return True


def _dtype_of(model: Any) -> str:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    float_dtypes = {
        str(v.dtype).removeprefix("mlx.core.")
        for _, v in tree_flatten(model.parameters())
        if mx.issubdtype(v.dtype, mx.floating)
    }
    return float_dtypes.pop() if len(float_dtypes) == 1 else ",".join(sorted(float_dtypes))


def load_model(
    path_or_repo: str | os.PathLike[str], *, float32_on_cpu: bool = True,
    chat_template: str | None = None, lazy: bool = False, steps: Steps = no_steps,
) -> tuple[Any, Any, ModelInfo]:
    """``(model, tokenizer, info)`` with mlx-lm (``lazy``: only shapes and dtypes, no weights)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load

    folder, model_id = resolve_model_path(path_or_repo)
    with steps("fingerprinting the weights"):
        fingerprint = model_fingerprint(folder)
    with steps("loading the weights" if not lazy else "opening the model"):
        model, tokenizer, config = load(str(folder), lazy=True, return_config=True,
                                        tokenizer_config=tokenizer_config(chat_template))
        if float32_on_cpu and mx.default_device() == mx.cpu:
            model.set_dtype(mx.float32)  # floating-point parameters only
        if not lazy:
            mx.eval(model.parameters())
    float_dtypes = {
        str(v.dtype).removeprefix("mlx.core.")
        for _, v in tree_flatten(model.parameters())
        if mx.issubdtype(v.dtype, mx.floating)
    }
    dtype = float_dtypes.pop() if len(float_dtypes) == 1 else ",".join(sorted(float_dtypes))
    layers = getattr(model, "layers", None)
    info = ModelInfo(
        model_id=model_id,
        path=folder,
        fingerprint=fingerprint,
        model_type=str(config.get("model_type", "unknown")),
        context_length=context_length_from_config(config),
        dtype=dtype,
        num_layers=len(layers) if layers is not None else 0,
        config=config,
    )
    logger.info(
        "loaded %s (%s, %d layers, %s, context %d, fingerprint %s)",
        info.model_id, info.model_type, info.num_layers, info.dtype,
        info.context_length, info.fingerprint[:12],
    )
    return model, tokenizer, info
