"""Constrained decoding: a ``Constraint`` (engine/api.py) -> an mlx-lm logits processor.

A logits processor has mlx-lm's signature ``processor(tokens, logits) -> logits``:
``tokens`` is the mx.array of token ids so far (prompt + output), ``logits`` the
``[1, vocab]`` scores of the next token; it returns them with the tokens the
constraint forbids masked to ``-inf``. The scheduler asks for one processor per
request (``logits_processor``) and applies it before sampling and log-probabilities.

Interface placeholder: the implementation (a grammar / JSON-schema matcher from a
well-kept library) lands with the real-client work; until then a request with a
constraint is refused with a clear 400.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from ..errors import RequestError
from .api import Constraint

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


def logits_processor(constraint: Constraint, tokenizer: Any, vocab_size: int) -> LogitsProcessor:
    """A fresh processor (it keeps per-request matcher state) for ``constraint``."""
    raise RequestError(f"constrained decoding ({constraint.kind}) is not available yet")
