"""Vision-language models through mlx-vlm (extra ``promptcache[vlm]``): ``load_vlm`` gives the
language model behind mlx-lm's interface and a ``VisionTower``. Families (``SUPPORTED_TYPES``):
llava, gemma3, qwen3_vl, qwen3_5 (one resolution); others raise ValueError."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..api import VisionInfo
from .vlm_text import HybridMRopeTextModel, MRopeTextModel, VLMTextModel

logger = logging.getLogger(__name__)

MLX_VLM_TESTED = "0.7.10"
SUPPORTED_TYPES = ("llava", "gemma3", "qwen3_vl", "qwen3_5", "qwen3_5_moe")
QWEN_TYPES = ("qwen3_vl", "qwen3_5", "qwen3_5_moe")  # the dynamic-resolution tower
HYBRID_TYPES = ("qwen3_5", "qwen3_5_moe")  # gated delta net + attention (mlx-lm's layers)


def is_vlm_config(config: dict[str, Any]) -> bool:
    return isinstance(config.get("vision_config"), dict) and bool(config["vision_config"])


@dataclass
class VisionTower:
    """Preprocessing and the vision encoder of one VLM (engine thread only); ``encode``: one image's
    features, the rows mlx-vlm writes over its placeholders (deepstack features appended)."""

    vlm: Any
    image_processor: Any
    info: VisionInfo
    calls: int = 0  # vision tower forwards (each encodes one image)
    side: int = 0  # > 0: every image is resized to side x side first (qwen3_vl)

    def preprocess(self, pixels: np.ndarray) -> dict[str, np.ndarray]:
        """RGB uint8 ``[H, W, 3]`` -> the model's processor outputs (``pixel_values``...)."""
        from PIL import Image

        im = Image.fromarray(pixels, mode="RGB")
        if self.side:
            im = im.resize((self.side, self.side), Image.Resampling.BICUBIC)
            area = self.side * self.side
            out = self.image_processor(im, return_tensors="np",
                                       size={"shortest_edge": area, "longest_edge": area})
        else:
            out = self.image_processor(im, return_tensors="np")
        return {k: np.asarray(v) for k, v in out.items()}

    def encode(self, pixels: np.ndarray) -> mx.array:
        """One image's features (one vision tower call)."""
        n = self.info.tokens_per_image
        proc = self.preprocess(pixels)
        pv = mx.array(proc["pixel_values"].astype(np.float32))
        self.calls += 1
        if self.info.model_type in QWEN_TYPES:
            tower = self.vlm.vision_tower
            grid = mx.array(proc["image_grid_thw"].astype(np.int32))
            feats, deep = tower(pv.astype(tower.patch_embed.proj.weight.dtype), grid)
            emb: mx.array = mx.concatenate([feats, *(deep or [])], axis=-1)
        else:
            ids = mx.full((1, n), self.info.placeholder_id, dtype=mx.int32)
            kw = {"mask": mx.ones((1, n), dtype=mx.int32)} if self.info.model_type == "gemma3" \
                else {}
            emb = self.vlm.get_input_embeddings(ids, pv, **kw).inputs_embeds[0]
        if emb.shape[0] != n:
            raise RuntimeError(f"the vision tower returned {emb.shape[0]} features for "
                               f"{n} placeholder tokens")
        return emb


def _settings_key(model_type: str, image_processor: Any, tokens: int, side: int) -> str:
    settings = image_processor.to_dict() if hasattr(image_processor, "to_dict") else {}
    text = json.dumps(settings, sort_keys=True, default=str, separators=(",", ":"))
    resize = f"|side={side}" if side else ""
    return f"{model_type}|tokens={tokens}{resize}|{text}"


@dataclass(frozen=True)
class _Family:
    """What differs between the families at load."""

    info: VisionInfo
    side: int = 0
    grid: tuple[int, int, int] = (0, 0, 0)
    deepstack: int = 0


def _token_id(hf: Any, token: str) -> int:
    tid = hf.convert_tokens_to_ids(token)
    return int(tid) if isinstance(tid, int) else -1


def _llava(folder: Path, config: dict[str, Any], proc: dict[str, Any], hf: Any,
           image_processor: Any) -> _Family:
    vc = config["vision_config"]
    image_token = str(proc.get("image_token") or "<image>")
    image_id = int(config.get("image_token_index", config.get("image_token_id", -1)))
    if image_id < 0 or _token_id(hf, image_token) != image_id:
        raise ValueError(f"{folder}: the tokenizer's {image_token!r} is not the model's "
                         f"image token {image_id}")
    patch = int(proc.get("patch_size") or vc.get("patch_size") or 14)
    crop = getattr(image_processor, "crop_size", None) or {}
    h = int(crop.get("height") or vc.get("image_size") or 336)
    w = int(crop.get("width") or vc.get("image_size") or 336)
    n = (h // patch) * (w // patch)
    if config.get("vision_feature_select_strategy", "default") != "default":
        n += 1  # "full" keeps the CLS feature
    return _Family(VisionInfo("llava", image_token, image_id, n,
                              _settings_key("llava", image_processor, n, 0)))


def _gemma3(folder: Path, config: dict[str, Any], proc: dict[str, Any], hf: Any,
            image_processor: Any) -> _Family:
    soft_id = int(config.get("image_token_index", -1))
    boi_id = int(config.get("boi_token_index", -1))
    eoi_id = int(config.get("eoi_token_index", -1))
    if min(soft_id, boi_id, eoi_id) < 0:
        raise ValueError(f"{folder}: a gemma3 config needs image_token_index, "
                         "boi_token_index and eoi_token_index")
    boi = str(hf.convert_ids_to_tokens(boi_id))
    n = int(config["text_config"].get("mm_tokens_per_image", 256))
    if int(proc.get("image_seq_length", n)) != n:
        raise ValueError(f"{folder}: processor image_seq_length {proc['image_seq_length']} "
                         f"!= mm_tokens_per_image {n}")
    nl = [int(t) for t in hf.encode("\n\n", add_special_tokens=False)]
    info = VisionInfo("gemma3", boi, boi_id, n, _settings_key("gemma3", image_processor, n, 0),
                      placeholder_token_id=soft_id, before=(*nl, boi_id), after=(eoi_id, *nl))
    return _Family(info)


def _qwen3_vl(folder: Path, config: dict[str, Any], proc: dict[str, Any], hf: Any,
              image_processor: Any) -> _Family:
    """Qwen3-VL and Qwen3.5 (the same tower and image tokens; Qwen3.5 without deepstack)."""
    model_type = str(config["model_type"])
    vc = config["vision_config"]
    image_id = int(config.get("image_token_id", -1))
    start_id = int(config.get("vision_start_token_id", -1))
    end_id = int(config.get("vision_end_token_id", -1))
    if min(image_id, start_id, end_id) < 0:
        raise ValueError(f"{folder}: a {model_type} config needs image_token_id, "
                         "vision_start_token_id and vision_end_token_id")
    patch = int(vc.get("patch_size", 16))
    merge = int(vc.get("spatial_merge_size", 2))
    grid_side = math.isqrt(int(vc.get("num_position_embeddings", 2304)))
    side = grid_side * patch
    if grid_side % merge:
        raise ValueError(f"{folder}: a {grid_side}-patch grid does not merge by {merge}")
    if int(getattr(image_processor, "patch_size", patch)) != patch \
            or int(getattr(image_processor, "merge_size", merge)) != merge:
        raise ValueError(f"{folder}: the image processor's patch / merge sizes differ from "
                         "the vision config's")
    m = grid_side // merge
    tokens = [str(hf.convert_ids_to_tokens(i)) for i in (start_id, image_id, end_id)]
    info = VisionInfo(model_type, tokens[1], image_id, m * m,
                      _settings_key(model_type, image_processor, m * m, side),
                      image_text="".join(tokens))
    deep = len(vc.get("deepstack_visual_indexes") or [])
    return _Family(info, side=side, grid=(1, m, m), deepstack=deep)


_FAMILIES = {"llava": _llava, "gemma3": _gemma3, "qwen3_vl": _qwen3_vl, "qwen3_5": _qwen3_vl,
             "qwen3_5_moe": _qwen3_vl}


def _mlx_lm_text_model(folder: Path, config: dict[str, Any], vlm: Any) -> Any:
    """mlx-lm's text model of a Qwen3.5 checkpoint, sharing the VLM's weight arrays."""
    from mlx.nn.layers.base import Module
    from mlx.nn.layers.quantized import quantize
    from mlx.utils import tree_flatten

    from ..mlx_compat import model_classes

    model_cls, args_cls = model_classes(str(config["model_type"]))
    model = model_cls(args_cls.from_dict(config))
    theirs = dict(tree_flatten(vlm.language_model.leaf_modules(),
                               is_leaf=Module.is_module))

    def quantized_as_theirs(path: str, _module: Any) -> bool | dict[str, Any]:
        m = theirs.get(path.removeprefix("language_model."))
        if m is None or not hasattr(m, "bits"):
            return False
        return {"group_size": int(m.group_size), "bits": int(m.bits),
                "mode": str(getattr(m, "mode", "affine"))}

    quantize(model, class_predicate=quantized_as_theirs)
    weights = [(f"language_model.{k}", v)
               for k, v in tree_flatten(vlm.language_model.parameters())]
    try:
        model.load_weights(weights, strict=True)
    except ValueError as e:
        raise ValueError(f"{folder}: mlx-lm's {config['model_type']} text model does not "
                         f"take the VLM's language weights: {e}") from e
    model.eval()  # as mlx-lm's load leaves it (its gated delta net's kernel is eval-only)
    return model.language_model


def load_vlm(folder: Path, config: dict[str, Any], *, float32_on_cpu: bool = True,
             chat_template: str | None = None, lazy: bool = False
             ) -> tuple[VLMTextModel, Any, VisionTower]:
    """``(text_model, tokenizer, vision)`` of a VLM folder (mlx-vlm + mlx-lm's tokenizer);
    ``lazy``: the weights are not read (a cache namespace needs only the structure)."""
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
    if not lazy:
        mx.eval(vlm.parameters())
    extra = {"chat_template": chat_template} if chat_template is not None else None
    tokenizer = load_tokenizer(folder, extra, eos_token_ids=config.get("eos_token_id"))
    image_processor = AutoImageProcessor.from_pretrained(str(folder), backend="pil")
    proc_file = folder / "processor_config.json"
    proc = json.loads(proc_file.read_text()) if proc_file.is_file() else {}
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    fam = _FAMILIES[model_type](folder, config, proc, hf, image_processor)
    text: VLMTextModel
    if model_type in HYBRID_TYPES:
        text = HybridMRopeTextModel(vlm, fam.grid, _mlx_lm_text_model(folder, config, vlm))
    elif fam.side:
        text = MRopeTextModel(vlm, fam.grid, fam.deepstack)
    else:
        text = VLMTextModel(vlm)
    logger.info("vision-language model %s: %d placeholder tokens per image%s", model_type,
                fam.info.tokens_per_image,
                f" (images resized to {fam.side}x{fam.side})" if fam.side else "")
    return text, tokenizer, VisionTower(vlm, image_processor, fam.info, side=fam.side)
