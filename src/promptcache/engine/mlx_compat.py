"""The one place that knows mlx-lm's internal layout (tested against mlx-lm 0.32.x).

Anything here may change between mlx-lm releases; pyproject pins the range.
"""

from __future__ import annotations

import importlib
from typing import Any


def model_classes(model_type: str) -> tuple[Any, Any]:
    """``(Model, ModelArgs)`` of an mlx-lm architecture, e.g. ``"llama"``.

    Every module in ``mlx_lm.models`` defines these two names; we import the module
    directly instead of calling mlx-lm's private class lookup.
    """
    if not model_type.replace("_", "").isalnum():
        raise ValueError(f"invalid model_type {model_type!r}")
    try:
        module = importlib.import_module(f"mlx_lm.models.{model_type}")
    except ImportError as e:
        raise ValueError(f"mlx-lm has no model type {model_type!r}") from e
    return module.Model, module.ModelArgs
