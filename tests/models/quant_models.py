"""A tiny llama with head_dim 64 for the KV quantization tests.

The standard tiny models have head_dim 16, below mx.quantize's smallest group (32), so
their KV is stored at full precision even with ``kv_bits`` set. This variant shares
their tokenizer and differs only in ``head_dim`` (and so in its random weights).
"""

from __future__ import annotations

import json
from pathlib import Path

from . import save_beside
from .tiny_models import ensure_built

HEAD_DIM = 64
NAME = "tiny-llama-hd64-v1"


def ensure_tiny_llama_hd64(base: Path, root: Path) -> Path:
    """``root/tiny-llama-hd64-v1``, built from the tiny llama folder ``base`` if missing."""
    return ensure_built(root / NAME, lambda tmp: _build(base, tmp))


def _build(base: Path, tmp: Path) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from promptcache.engine.mlx_compat import model_classes

    config = json.loads((base / "config.json").read_text())
    config["head_dim"] = HEAD_DIM
    model_cls, args_cls = model_classes(config["model_type"])
    mx.random.seed(64)
    model = model_cls(args_cls.from_dict(config))
    weights = {k: v.astype(mx.float32) for k, v in tree_flatten(model.parameters())}
    save_beside(tmp, dict(weights), config, base)
