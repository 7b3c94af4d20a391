"""The tiny random-weight VLM (mlx-vlm llava, built offline) and prompt helpers."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_vlm_path(models_root: Path) -> Path:
    from models.tiny_vlm import ensure_tiny_vlm

    return ensure_tiny_vlm(models_root)



@pytest.fixture(scope="session")
def tiny_gemma3_vlm_path(models_root: Path) -> Path:
    from models.tiny_vlm_families import ensure_tiny_gemma3_vlm

    return ensure_tiny_gemma3_vlm(models_root)


@pytest.fixture(scope="session")
def tiny_qwen3_vl_path(models_root: Path) -> Path:
    from models.tiny_vlm_families import ensure_tiny_qwen3_vl

    return ensure_tiny_qwen3_vl(models_root)


@pytest.fixture(scope="session")
def tiny_qwen3_5_vlm_path(models_root: Path) -> Path:
    from models.tiny_vlm_families import ensure_tiny_qwen3_5_vlm

    return ensure_tiny_qwen3_5_vlm(models_root)


@pytest.fixture(scope="session")
def tiny_qwen3_5_moe_vlm_path(models_root: Path) -> Path:
    from models.tiny_vlm_families import ensure_tiny_qwen3_5_moe_vlm

    return ensure_tiny_qwen3_5_moe_vlm(models_root)
