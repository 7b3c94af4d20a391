"""CORS (``--allowed-origins``): a browser's preflight to the API is answered for an
allowed origin, before the API key is asked for; another origin gets no allow header;
without the option the server sends no CORS headers (as before)."""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient

from promptcache.cli import build_parser
from promptcache.cli.serve_cmd import build_configs
from promptcache.server import create_app
from promptcache.serving_config import ServerConfig

APP = "https://app.example.com"
PREFLIGHT = {"Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def _client(origins: tuple[str, ...], api_key: str | None = None) -> TestClient:
    return TestClient(create_app(FakeEngine(), ServerConfig(allowed_origins=origins,
                                                            api_key=api_key)))


def test_a_preflight_from_an_allowed_origin_is_answered() -> None:
    client = _client((APP, "http://localhost:3000"), api_key="secret")
    r = client.options("/v1/chat/completions", headers={"Origin": APP, **PREFLIGHT})
    assert r.status_code == 200  # no API key asked for: a browser sends none here
    assert r.headers["access-control-allow-origin"] == APP
    assert "POST" in r.headers["access-control-allow-methods"].split(", ")
    assert r.headers["access-control-allow-headers"] == "authorization,content-type"
    assert "Origin" in r.headers["vary"].split(", ")
    assert "access-control-allow-credentials" not in r.headers
    # the request itself carries the allow header (and still needs the key)
    r = client.post("/v1/chat/completions", json=CHAT,
                    headers={"Origin": APP, "Authorization": "Bearer secret"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == APP
    assert r.headers["access-control-expose-headers"] == "Retry-After"
    r = client.post("/v1/chat/completions", json=CHAT, headers={"Origin": APP})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == APP


def test_another_origin_gets_no_allow_header() -> None:
    client = _client((APP,))
    r = client.options("/v1/chat/completions",
                       headers={"Origin": "https://evil.example", **PREFLIGHT})
    assert r.status_code == 400  # Starlette: "Disallowed CORS origin"
    assert "access-control-allow-origin" not in r.headers
    r = client.post("/v1/chat/completions", json=CHAT,
                    headers={"Origin": "https://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_any_origin() -> None:
    r = _client(("*",)).options("/v1/messages",
                                headers={"Origin": "http://localhost:5173", **PREFLIGHT})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


def test_no_cors_by_default() -> None:
    client = _client(())
    r = client.options("/v1/chat/completions", headers={"Origin": APP, **PREFLIGHT})
    assert r.status_code == 405
    assert not [h for h in r.headers if h.startswith("access-control-")]
    r = client.post("/v1/chat/completions", json=CHAT, headers={"Origin": APP})
    assert r.status_code == 200
    assert not [h for h in r.headers if h.startswith("access-control-")]


def test_the_option() -> None:
    def srv(*argv: str) -> ServerConfig:
        return build_configs(build_parser().parse_args(["serve", "--no-ssd", *argv]))[3]

    assert srv().allowed_origins == ()
    assert srv("--allowed-origins", "https://a.example, http://localhost:3000/"
               ).allowed_origins == ("https://a.example", "http://localhost:3000")
    assert srv("--allowed-origins", "*").allowed_origins == ("*",)
    for bad in ("a.example", "https://a.example,,", "*,https://a.example"):
        with pytest.raises(ValueError, match="allowed.origins"):
            srv("--allowed-origins", bad)
