"""Prompts with images for the engine tests: render, expand placeholders, digests."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from promptcache.engine.api import (
    GenerationRequest,
    SamplingParams,
    expand_placeholders,
    image_digest,
)


def request(engine: Any, messages: Sequence[dict[str, Any]], images: Sequence[np.ndarray],
            *, max_tokens: int = 6, use_cache: bool = True, request_id: str = ""
            ) -> GenerationRequest:
    """``messages`` with ``<image>`` in their text, one per image (in order)."""
    info = engine.vision
    tokens, starts = engine.render_chat_with_offsets(list(messages))
    pairs = [(image_digest(px, info.settings_key), px) for px in images]
    tokens, starts, placed = expand_placeholders(tokens, starts, info, pairs)
    return GenerationRequest(prompt_tokens=tuple(tokens), message_starts=starts,
                             images=placed, use_cache=use_cache, request_id=request_id,
                             sampling=SamplingParams(max_tokens=max_tokens))


def run(engine: Any, messages: Sequence[dict[str, Any]], images: Sequence[np.ndarray],
        **kw: Any) -> Any:
    return engine.submit(request(engine, messages, images, **kw)).result()


def image(seed: int, h: int = 40, w: int = 48) -> np.ndarray:
    """A random RGB image (uint8 [H, W, 3])."""
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


class LogitsRecorder:
    """The engine's logits hook: every sampling step's logits, per request id."""

    def __init__(self) -> None:
        self.by_request: dict[str, list[np.ndarray]] = defaultdict(list)

    def __call__(self, request_id: str, step: int, logits: np.ndarray) -> None:
        self.by_request[request_id].append(logits)
