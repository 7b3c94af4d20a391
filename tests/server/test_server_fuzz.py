"""Fuzz the OpenAPI schema (schemathesis, positive + negative cases): never a 5xx.

Runs in process against the fake engine: ~10 generated cases per operation (plus
schemathesis coverage cases) x every operation, /v1/responses and /v1/messages included.
"""

from __future__ import annotations

from collections import Counter

import schemathesis
from fake_engine import FakeEngine
from hypothesis import HealthCheck, settings

from promptcache.server import create_app
from promptcache.serving_config import ServerConfig

ENGINE = FakeEngine(reply="ok")
APP = create_app(ENGINE, ServerConfig())
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)
STATUSES: Counter[int] = Counter()
PATHS: Counter[str] = Counter()


@schema.parametrize()
@settings(max_examples=10, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_server_errors(case: schemathesis.Case) -> None:
    response = case.call()
    STATUSES[response.status_code] += 1
    PATHS[f"{case.method} {case.path}"] += 1
    assert response.status_code < 500, (case.method, case.path, case.body, response.text)


def test_fuzz_summary() -> None:
    """Runs after the fuzz cases (definition order): they covered ~200 requests."""
    total = sum(STATUSES.values())
    print(f"fuzz: {total} requests, statuses {dict(sorted(STATUSES.items()))}")
    if total == 0:  # the fuzz cases were deselected
        return
    assert total >= 150
    assert all(status < 500 for status in STATUSES)
    for op in ("POST /v1/responses", "GET /v1/responses/{response_id}", "POST /v1/messages",
               "POST /v1/messages/count_tokens"):
        assert PATHS[op] >= 10, (op, dict(PATHS))
