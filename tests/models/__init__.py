"""Tiny random-weight test models, built offline and deterministically (not part of the
installed package: only the tests and the ``bench/`` scripts use them).

- ``tiny_models``: llama, gemma3_text (sliding window), hybrid (nemotron_h) and the
  "scripted" model; the byte-level BPE tokenizer they share.
- ``tiny_families``: one tiny model per architecture family of the test matrix, each
  with its family's chat template (``family_templates``).
- ``tiny_vlm``, ``tiny_vlm_families``: tiny mlx-vlm models (llava; gemma3, qwen3_vl,
  qwen3_5, qwen3_5_moe).

``tests/`` is on ``sys.path`` under pytest (the top-level ``conftest.py``), so the tests
import ``models.tiny_models``; a script run outside pytest puts ``tests/`` on its path
first (as the ``bench/`` scripts do). Built models are cached in ``models_root()``.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def models_root() -> Path:
    """The folder that caches built test models: ``$PROMPTCACHE_TEST_MODELS``, else
    ``<repo>/.models`` (gitignored)."""
    env = os.environ.get("PROMPTCACHE_TEST_MODELS")
    return Path(env) if env else REPO_ROOT / ".models"


def save_beside(tmp: Path, weights: dict[str, object], config: dict[str, object],
                base: Path) -> None:
    """Write a built checkpoint into ``tmp``: the float32 ``weights`` as MLX safetensors,
    ``config`` as config.json, and every other file of the folder ``base`` (its
    tokenizer) copied as it is."""
    import json
    import shutil

    import mlx.core as mx

    arrays = {k: v for k, v in weights.items() if isinstance(v, mx.array)}
    mx.save_safetensors(str(tmp / "model.safetensors"), arrays, metadata={"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for f in base.iterdir():
        if f.name not in ("config.json", "model.safetensors") and f.is_file():
            shutil.copy(f, tmp / f.name)
