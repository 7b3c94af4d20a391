"""Images in a prompt's prefill: features from the vision-embedding cache or the tower, written over
each image's placeholders; chunks without image tokens prefill from ids."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from ...errors import RequestError
from ..api import ImageInput, VisionInfo
from .vision_cache import VisionCache


class VisionEncoder:
    """The vision tower of a VLM behind the vision-embedding cache."""

    def __init__(self, tower: Any, cache: VisionCache | None = None) -> None:
        self.tower = tower  # models.vlm.VisionTower
        self.cache = cache

    @property
    def info(self) -> VisionInfo:
        info: VisionInfo = self.tower.info
        return info

    @property
    def tower_calls(self) -> int:
        return int(self.tower.calls)

    def features(self, image: ImageInput) -> mx.array:
        if self.cache is not None:
            known = self.cache.get(image.digest)
            if known is not None:
                return known
        feats: mx.array = self.tower.encode(image.pixels)
        if self.cache is not None:
            self.cache.put(image.digest, feats)
            self.cache.counters.tower_calls = self.tower_calls
        return feats

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tower_calls": self.tower_calls,
                               "tokens_per_image": self.info.tokens_per_image}
        if self.cache is not None:
            out.update({k: v for k, v in self.cache.stats().to_dict().items()
                        if k != "tower_calls"})
        return out


def validate_images(images: Sequence[ImageInput], prompt: np.ndarray,
                    info: VisionInfo | None) -> None:
    """Every image covers exactly its placeholders, in order, and no more; else ``RequestError``."""
    if not images:
        if info is not None and bool(np.any(prompt == info.placeholder_id)):
            raise RequestError(f"the prompt contains the image token {info.image_token!r} "
                               "but no image")
        return
    if info is None:
        raise RequestError("this model is text-only: images are not supported")
    n = int(prompt.shape[0])
    prev_end = 0
    for i, im in enumerate(images):
        if not isinstance(im, ImageInput):
            raise RequestError(f"images[{i}] must be an ImageInput")
        px = im.pixels
        if not isinstance(px, np.ndarray) or px.dtype != np.uint8 or px.ndim != 3 \
                or px.shape[2] != 3 or px.shape[0] < 1 or px.shape[1] < 1:
            raise RequestError(f"images[{i}]: pixels must be uint8 [H, W, 3]")
        if not isinstance(im.digest, bytes) or len(im.digest) != 32:
            raise RequestError(f"images[{i}]: digest must be 32 bytes")
        if im.length != info.tokens_per_image:
            raise RequestError(f"images[{i}] covers {im.length} tokens; the model uses "
                               f"{info.tokens_per_image} per image")
        if im.start < prev_end or im.end > n:
            raise RequestError(f"images[{i}]: placeholder span [{im.start}, {im.end}) "
                               "overlaps another image or the prompt's end")
        if not bool(np.all(prompt[im.start:im.end] == info.placeholder_id)):
            raise RequestError(f"images[{i}]: its span does not hold image tokens")
        prev_end = im.end
    total = int(np.count_nonzero(prompt == info.placeholder_id))
    if total != len(images) * info.tokens_per_image:
        raise RequestError(f"the prompt has {total} image tokens for {len(images)} images")


class ImagePrefill:
    """The input embeddings (and M-RoPE positions) of one request's prefill chunks."""

    def __init__(self, encoder: VisionEncoder, images: Sequence[ImageInput]) -> None:
        self.encoder = encoder
        self.images = list(images)
        self._feats: dict[int, mx.array] = {}

    def _features(self, i: int) -> mx.array:
        feats = self._feats.get(i)
        if feats is None:
            feats = self.encoder.features(self.images[i])
            self._feats[i] = feats
        return feats

    def embeddings(self, model: Any, tokens: mx.array, start: int, end: int
                   ) -> mx.array | None:
        """``[1, end - start, hidden]`` for the chunk ``[start, end)``; None if it has no image."""
        emb, _ = self._merge(model, tokens, start, end)
        return emb

    def _merge(self, model: Any, tokens: mx.array, start: int, end: int
               ) -> tuple[mx.array | None, list[mx.array] | None]:
        """The chunk's embeddings and, with deepstack, each layer's features of its image rows."""
        hits = [(i, im) for i, im in enumerate(self.images) if im.start < end and im.end > start]
        if not hits:
            return None, None
        emb: mx.array = model.embed(tokens)
        hidden = int(emb.shape[-1])
        extra: list[mx.array] = []
        for i, im in hits:
            feats = self._features(i)
            a, b = max(im.start, start), min(im.end, end)
            rows = feats[a - im.start:b - im.start]
            emb[0, a - start:b - start] = rows[:, :hidden].astype(emb.dtype)
            extra.append(rows[:, hidden:].astype(emb.dtype))
        layers = int(getattr(model, "deepstack_layers", 0))
        if not layers:
            return emb, None
        deep = mx.concatenate(extra, axis=0)
        return emb, [deep[:, k * hidden:(k + 1) * hidden] for k in range(layers)]

    def forward(self, model: Any, tokens: mx.array, caches: list[Any], start: int, end: int
                ) -> mx.array:
        """The chunk ``[start, end)`` through ``model`` (lazy logits), image rows included."""
        emb, deep = self._merge(model, tokens, start, end)
        if bool(getattr(model, "mrope", False)):
            pos, delta = model.positions(self.images, start, end)
            mask = None
            if deep is not None:
                ids = np.zeros(end - start, dtype=bool)
                for im in self.images:
                    ids[max(im.start, start) - start:max(min(im.end, end) - start, 0)] = True
                mask = mx.array(ids)[None]
            out: mx.array = model(tokens, cache=caches, input_embeddings=emb, positions=pos,
                                  delta=delta, visual_mask=mask, deepstack=deep)
            return out
        if emb is None:
            res: mx.array = model(tokens, cache=caches)
            return res
        res = model(tokens, cache=caches, input_embeddings=emb)
        return res
