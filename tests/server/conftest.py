"""Fixtures of the server tests: a fake engine and an in-process client."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

sys.path.insert(0, str(Path(__file__).parent))

from fake_engine import FakeEngine  # noqa: E402

from promptcache.server import create_app  # noqa: E402
from promptcache.serving_config import ServerConfig  # noqa: E402


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(engine: FakeEngine) -> TestClient:
    return TestClient(create_app(engine, ServerConfig()))
