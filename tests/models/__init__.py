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
