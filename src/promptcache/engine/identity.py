"""A model's cache identity without an engine (``cache export`` / ``import``): fingerprint, lazy
structure (a vision-language model's too), namespaces, chat template."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mlx_lm.models.cache import make_prompt_cache

from ..config import CacheConfig
from ..meta import DEFAULT_TENANT, Namespace
from .cache_port import Namespaces
from .formats.templates import ChatTemplate
from .payload import adapters
from .payload.quant import from_config as kv_quant_of
from .steps import Steps, no_steps


@dataclass(frozen=True)
class ModelIdentity:
    model_id: str
    fingerprint: str
    kv_spec: str
    namespaces: Namespaces
    templates: ChatTemplate

    def namespace(self, tenant: str = DEFAULT_TENANT) -> Namespace:
        return self.namespaces(tenant)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], tools: Any = None,
                    add_generation_prompt: bool = True) -> list[int]:
        return self.templates.render(messages, tools, add_generation_prompt)


def open_identity(model: str | os.PathLike[str], cache_config: CacheConfig,
                  *, steps: Steps = no_steps) -> ModelIdentity:
    """The identity of a model folder or HF repo id (ValueError, one line, otherwise)."""
    from .models.loader import load_model_or_vlm

    loaded, tokenizer, info, _ = load_model_or_vlm(model, lazy=True, steps=steps)
    try:
        spec = adapters.kv_spec(loaded, make_prompt_cache(loaded),
                                quant=kv_quant_of(cache_config))
    except ValueError as e:
        raise ValueError(f"model {info.model_id}: {e}") from e
    return ModelIdentity(
        model_id=info.model_id, fingerprint=info.fingerprint, kv_spec=spec,
        namespaces=Namespaces(info.fingerprint, cache_config.block_size, spec),
        templates=ChatTemplate(tokenizer, token_limit=info.context_length))
