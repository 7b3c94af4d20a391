"""Vision-language models through mlx-vlm (the optional extra ``promptcache[vlm]``).

``is_vlm_config(config)`` tells a VLM folder (its config has a ``vision_config``) from
a text model; ``load_vlm(folder)`` loads it with ``mlx_vlm.utils.load_model`` and
returns what the engine needs:

- ``VLMTextModel``: the language model of the VLM with mlx-lm's calling convention
  (``model(tokens, cache=..., input_embeddings=...) -> logits``, ``.layers``), so the
  scheduler, the batched decode, the cache adapters and the save points treat it like
  any mlx-lm model (mlx-lm's KV caches: mlx-vlm's attention uses the same
  ``update_and_fetch`` / ``make_mask`` protocol);
- ``VisionTower``: image preprocessing (the model's Hugging Face image processor,
  Pillow backend) and the vision tower + projector (``encode``: one image's features,
  one row per placeholder token), plus the ``VisionInfo`` the server needs.

Supported model types: those whose image features replace the image placeholder
tokens one for one in the input embeddings and whose text model uses ordinary
positions (``SUPPORTED_TYPES``). Others (M-RoPE positions, tiling, learned
separators) raise a clear ValueError at load.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..api import VisionInfo

logger = logging.getLogger(__name__)

MLX_VLM_TESTED = "0.7.10"
# features replace placeholder tokens 1:1, sequential positions, a fixed crop
SUPPORTED_TYPES = ("llava",)


def is_vlm_config(config: dict[str, Any]) -> bool:
    return isinstance(config.get("vision_config"), dict) and bool(config["vision_config"])


class VLMTextModel:
    """The VLM's language model with mlx-lm's interface (what the scheduler, the
    batch and ``make_prompt_cache`` use: call, ``layers``, ``parameters``)."""

    def __init__(self, vlm: Any) -> None:
        self.language_model = vlm.language_model

    def __call__(self, inputs: mx.array, cache: Any = None,
                 input_embeddings: mx.array | None = None) -> mx.array:
        out = self.language_model(inputs, inputs_embeds=input_embeddings, cache=cache)
        logits: mx.array = out.logits if hasattr(out, "logits") else out
        return logits

    def parameters(self) -> Any:
        return self.language_model.parameters()

    @property
    def layers(self) -> list[Any]:
        return list(self.language_model.layers)

    def embed(self, tokens: mx.array) -> mx.array:
        """Token embeddings ``[1, n, hidden]`` of ``tokens`` ``[1, n]``."""
        emb: mx.array = self.language_model.model.embed_tokens(tokens)
        return emb


@dataclass
class VisionTower:
    """Preprocessing and the vision encoder of one VLM (engine thread only)."""

    vlm: Any
    image_processor: Any
    info: VisionInfo
    calls: int = 0  # vision tower forwards (each encodes one image)

    def preprocess(self, pixels: np.ndarray) -> mx.array:
        """RGB uint8 ``[H, W, 3]`` -> the model's ``pixel_values`` ``[1, C, h, w]``."""
        from PIL import Image

        out = self.image_processor(Image.fromarray(pixels, mode="RGB"), return_tensors="np")
        return mx.array(np.asarray(out["pixel_values"], dtype=np.float32))

    def encode(self, pixels: np.ndarray) -> mx.array:
        """One image's features ``[tokens_per_image, hidden]`` (one vision tower call)."""
        n = self.info.tokens_per_image
        ids = mx.full((1, n), self.info.image_token_id, dtype=mx.int32)
        self.calls += 1
        emb = self.vlm.get_input_embeddings(ids, self.preprocess(pixels)).inputs_embeds
        if emb.shape[1] != n:
            raise RuntimeError(f"the vision tower returned {emb.shape[1]} features for "
                               f"{n} placeholder tokens")
        feats: mx.array = emb[0]
        return feats


def _tokens_per_image(config: dict[str, Any], proc: dict[str, Any], image_processor: Any
                      ) -> int:
    vc = config["vision_config"]
    patch = int(proc.get("patch_size") or vc.get("patch_size") or 14)
    crop = getattr(image_processor, "crop_size", None) or {}
    h = int(crop.get("height") or vc.get("image_size") or 336)
    w = int(crop.get("width") or vc.get("image_size") or 336)
    n = (h // patch) * (w // patch)
    if config.get("vision_feature_select_strategy", "default") != "default":
        n += 1  # "full" keeps the CLS feature
    return n


def _settings_key(model_type: str, image_processor: Any, tokens: int) -> str:
    settings = image_processor.to_dict() if hasattr(image_processor, "to_dict") else {}
    text = json.dumps(settings, sort_keys=True, default=str, separators=(",", ":"))
    return f"{model_type}|tokens={tokens}|{text}"


def load_vlm(folder: Path, config: dict[str, Any], *, float32_on_cpu: bool = True
             ) -> tuple[VLMTextModel, Any, VisionTower]:
    """``(text_model, tokenizer, vision)`` of a VLM folder (mlx-vlm + mlx-lm's tokenizer)."""
    model_type = str(config.get("model_type"))
    if model_type not in SUPPORTED_TYPES:
        raise ValueError(f"vision-language model type {model_type!r} is not supported yet "
                         f"(supported: {', '.join(SUPPORTED_TYPES)})")
    try:
        from mlx_vlm.utils import load_model as vlm_load_model
    except ImportError as e:
        raise ValueError(f"{folder} is a vision-language model: install the extra "
                         "promptcache[vlm] (mlx-vlm)") from e
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from transformers import AutoImageProcessor

    vlm = vlm_load_model(folder, lazy=True)
    if float32_on_cpu and mx.default_device() == mx.cpu:
        vlm.set_dtype(mx.float32)
    mx.eval(vlm.parameters())
    tokenizer = load_tokenizer(folder, eos_token_ids=config.get("eos_token_id"))
    image_processor = AutoImageProcessor.from_pretrained(str(folder), backend="pil")
    proc_file = folder / "processor_config.json"
    proc = json.loads(proc_file.read_text()) if proc_file.is_file() else {}
    image_token = str(proc.get("image_token") or "<image>")
    image_id = int(config.get("image_token_index", config.get("image_token_id", -1)))
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    if image_id < 0 or hf.convert_tokens_to_ids(image_token) != image_id:
        raise ValueError(f"{folder}: the tokenizer's {image_token!r} is not the model's "
                         f"image token {image_id}")
    tokens = _tokens_per_image(config, proc, image_processor)
    info = VisionInfo(model_type=model_type, image_token=image_token, image_token_id=image_id,
                      tokens_per_image=tokens,
                      settings_key=_settings_key(model_type, image_processor, tokens))
    logger.info("vision-language model %s: %d placeholder tokens per image", model_type, tokens)
    return VLMTextModel(vlm), tokenizer, VisionTower(vlm, image_processor, info)
