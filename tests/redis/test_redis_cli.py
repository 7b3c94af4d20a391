"""`promptcache serve --redis-*` options -> RedisConfig."""

from __future__ import annotations

import pytest

from promptcache.cli import build_parser
from promptcache.cli.serve_cmd import build_redis_config
from promptcache.config import RedisConfig


def cfg(*argv: str) -> RedisConfig | None:
    return build_redis_config(build_parser().parse_args(["serve", *argv]))


def test_redis_options() -> None:
    assert cfg() is None
    c = cfg("--redis-url", "redis+cluster://10.0.0.1:7000", "--redis-ttl", "2h",
            "--redis-timeout-ms", "20", "--redis-prefix", "pc")
    assert c is not None
    assert (c.url, c.is_cluster, c.ttl_seconds, c.timeout_s, c.prefix, c.policy) == (
        "redis+cluster://10.0.0.1:7000", True, 7200.0, 0.02, "pc", "write_through")
    c = cfg("--redis-url", "redis://h:1", "--redis-cluster")
    assert c is not None and c.is_cluster
    assert cfg("--redis-url", "redis://h:1", "--no-cache") is None


@pytest.mark.parametrize("argv, match", [
    (("--redis-cluster",), "needs --redis-url"),
    (("--redis-url", "http://h:1"), "redis url"),
    (("--redis-url", "redis://h:1", "--redis-ttl", "soon"), "duration|invalid"),
    (("--redis-url", "redis://h:1", "--redis-timeout-ms", "0"), "timeout"),
    (("--redis-url", "redis://h:1", "--redis-prefix", "a b"), "prefix"),
])
def test_bad_redis_options(argv: tuple[str, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cfg(*argv)
