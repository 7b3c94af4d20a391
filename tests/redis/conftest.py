"""Fixtures of the Redis tier tests: a real redis-server (session-wide, flushed per
test), tiers built on it, and block helpers."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from redis_servers import REDIS_SERVER, RedisServer  # noqa: E402

from promptcache.config import RedisConfig  # noqa: E402
from promptcache.tiers.redis import RedisTier  # noqa: E402

if REDIS_SERVER is None:  # CI installs it (.ci/run); a laptop without it skips
    pytest.skip("redis-server is not installed", allow_module_level=True)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    srv = RedisServer(tmp_path_factory.mktemp("redis"), unix_socket=True).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    redis_server.client().flushall()
    return redis_server.url


@pytest.fixture
def make_tier() -> Iterator[Callable[..., RedisTier]]:
    tiers: list[RedisTier] = []

    def make(url: str, **kw: object) -> RedisTier:
        opts = {k: kw.pop(k) for k in ("clock", "start_prober") if k in kw}
        # a generous default: a CPU-starved machine must not turn a slow local reply
        # into a timeout (the tests that want timeouts set their own)
        kw.setdefault("timeout_s", 2.0)
        tier = RedisTier(RedisConfig(url=url, **kw), **opts)  # type: ignore[arg-type]
        tiers.append(tier)
        return tier

    yield make
    for t in tiers:
        t.close()
