"""A VLM's language model behind mlx-lm's calling convention (plain, Qwen3-VL M-RoPE, Qwen3.5
hybrid).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from ..api import ImageInput


def _mlx_lm_caches(language_model: Any) -> list[Any]:
    """mlx-lm cache objects of the kinds the model asks for (the engine batches mlx-lm's)."""
    if not hasattr(language_model, "make_cache"):
        return [KVCache() for _ in language_model.layers]
    out: list[Any] = []
    for c in language_model.make_cache():
        kind = type(c).__name__
        if kind == "KVCache":
            out.append(KVCache())
        elif kind == "RotatingKVCache":
            out.append(RotatingKVCache(max_size=int(c.max_size), keep=int(c.keep)))
        else:
            raise ValueError(f"the language model asks for a {kind} cache; the vision path "
                             "supports KVCache and RotatingKVCache")
    return out


class VLMTextModel:
    """The VLM's language model with mlx-lm's interface; positions are the caches' offsets."""

    mrope = False
    deepstack_layers = 0

    def __init__(self, vlm: Any) -> None:
        self.language_model = vlm.language_model
        self.hidden_size = int(self.language_model.model.embed_tokens.weight.shape[1])
        self._caches = self.make_cache()  # checked at load

    def __call__(self, inputs: mx.array, cache: Any = None,
                 input_embeddings: mx.array | None = None) -> mx.array:
        out = self.language_model(inputs, inputs_embeds=input_embeddings, cache=cache)
        logits: mx.array = out.logits if hasattr(out, "logits") else out
        return logits

    def make_cache(self) -> list[Any]:
        return _mlx_lm_caches(self.language_model)

    def parameters(self) -> Any:
        return self.language_model.parameters()

    @property
    def layers(self) -> list[Any]:
        return list(self.language_model.layers)

    def embed(self, tokens: mx.array) -> mx.array:
        """Token embeddings ``[1, n, hidden]`` of ``tokens`` ``[1, n]``."""
        emb: mx.array = self.language_model.model.embed_tokens(tokens)
        return emb


def mrope_positions(images: Sequence[ImageInput], grid: tuple[int, int, int], start: int,
                    end: int) -> tuple[np.ndarray, int]:
    """Qwen's 3-D rotary positions of tokens ``[start, end)`` and the delta after ``end``.

    A function of the image spans and the LLM grid only, so a restored prefix continues exactly
    (``get_rope_index``)."""
    t, h, w = grid
    n, adv = t * h * w, max(t, h, w) - t * h * w
    idx = np.arange(start, end, dtype=np.int64)
    pos = np.broadcast_to(idx, (3, end - start)).copy()
    delta = 0  # of the images before the current one
    for im in images:
        if im.length != n:
            raise ValueError(f"an image of {im.length} tokens on a grid of {n}")
        if im.start >= end:
            break
        inside = (idx >= im.start) & (idx < im.end)
        if inside.any():
            k = idx[inside] - im.start
            p = im.start + delta
            pos[0, inside] = p + k // (h * w)
            pos[1, inside] = p + (k // w) % h
            pos[2, inside] = p + k % w
        pos[:, idx >= im.end] += adv
        if im.end > end:
            break
        delta += adv
    return pos, delta


class MRopeTextModel(VLMTextModel):
    """A language model with Qwen's multimodal rotary positions (``qwen3_vl``).

    The last cache, an ``ArraysCache``, holds each row's position delta and moves with the request's
    state; so the model is not truncatable (restores at snapshots only)."""

    mrope = True

    offset_layer = 0  # the index of a KV cache (its offset is the row's token count)

    def __init__(self, vlm: Any, grid: tuple[int, int, int], deepstack_layers: int) -> None:
        super().__init__(vlm)
        self.grid = grid
        self.deepstack_layers = deepstack_layers

    def make_cache(self) -> list[Any]:
        return [*super().make_cache(), ArraysCache(1)]

    def positions(self, images: Sequence[ImageInput], start: int, end: int
                  ) -> tuple[np.ndarray, int]:
        return mrope_positions(images, self.grid, start, end)

    def __call__(self, inputs: mx.array, cache: Any = None,
                 input_embeddings: mx.array | None = None, *,
                 positions: np.ndarray | None = None, delta: int = 0,
                 visual_mask: mx.array | None = None,
                 deepstack: list[mx.array] | None = None) -> mx.array:
        """``positions`` ``[3, L]`` with ``delta`` after them; else cache offset + stored delta."""
        b, n = inputs.shape[0], inputs.shape[1]
        if cache is None:
            cache = self.make_cache()
        kv, state = list(cache[:-1]), cache[-1]
        if positions is not None:
            if b != 1 or positions.shape != (3, n):
                raise ValueError(f"positions {positions.shape} for inputs {inputs.shape}")
            pos = mx.array(positions.astype(np.int32))[:, None, :]
            state[0] = mx.array([[delta]], dtype=mx.int32)
        else:
            off = kv[self.offset_layer].offset
            base = (mx.array([[int(off)]], dtype=mx.int32) if isinstance(off, int)
                    else off.astype(mx.int32).reshape(-1, 1))
            d = state[0] if state[0] is not None else mx.zeros((b, 1), dtype=mx.int32)
            state[0] = d
            row = base + d + mx.arange(n, dtype=mx.int32)[None]
            pos = mx.broadcast_to(row[None], (3, b, n))
        return self._forward(inputs, kv, input_embeddings, pos, visual_mask, deepstack)

    def _forward(self, inputs: mx.array, kv: list[Any], input_embeddings: mx.array | None,
                 pos: mx.array, visual_mask: mx.array | None,
                 deepstack: list[mx.array] | None) -> mx.array:
        """The language model at positions ``pos`` ``[3, B, L]`` on the layers' caches."""
        kwargs: dict[str, Any] = {}
        if deepstack is not None:
            kwargs = {"visual_pos_masks": visual_mask, "deepstack_visual_embeds": deepstack}
        out = self.language_model(inputs, inputs_embeds=input_embeddings, cache=kv,
                                  position_ids=pos, **kwargs)
        logits: mx.array = out.logits if hasattr(out, "logits") else out
        return logits


class HybridMRopeTextModel(MRopeTextModel):
    """Qwen3.5: each layer runs as its cache kind's library runs it (mlx-vlm keeps batch state on
    caches): linear layers mlx-lm's on ``ArraysCache``, attention mlx-vlm's with M-RoPE on
    ``KVCache``."""

    def __init__(self, vlm: Any, grid: tuple[int, int, int], text: Any) -> None:
        self.text = text  # mlx-lm's qwen3_5 TextModel (the VLM's weights)
        super().__init__(vlm, grid, 0)
        self.offset_layer = int(text.model.fa_idx)
        self.vlm_layers = list(vlm.language_model.model.layers)

    def make_cache(self) -> list[Any]:
        return [*self.text.make_cache(), ArraysCache(1)]

    @property
    def layers(self) -> list[Any]:
        return list(self.text.layers)

    def _forward(self, inputs: mx.array, kv: list[Any], input_embeddings: mx.array | None,
                 pos: mx.array, visual_mask: mx.array | None,
                 deepstack: list[mx.array] | None) -> mx.array:
        from mlx_lm.models.base import create_attention_mask, create_ssm_mask

        inner = self.text.model
        h = inner.embed_tokens(inputs) if input_embeddings is None else input_embeddings
        fa_mask = create_attention_mask(h, kv[inner.fa_idx])
        ssm_mask = create_ssm_mask(h, kv[inner.ssm_idx])
        # cos / sin once for all attention layers (None: the fused rotary kernel applies them)
        rotary = self.vlm_layers[inner.fa_idx].self_attn.rotary_emb
        cos_sin = None if rotary.fused_apply else rotary(h, pos)
        for layer, vlm_layer, c in zip(inner.layers, self.vlm_layers, kv, strict=True):
            if layer.is_linear:
                h = layer(h, mask=ssm_mask, cache=c)
            else:
                h = vlm_layer(h, mask=fa_mask, cache=c, position_ids=pos,
                              position_embeddings=cos_sin)
        out = inner.norm(h)
        logits: mx.array = (inner.embed_tokens.as_linear(out)
                            if self.text.args.tie_word_embeddings else self.text.lm_head(out))
        return logits
