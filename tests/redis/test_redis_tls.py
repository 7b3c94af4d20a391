"""rediss:// (TLS): a redis-server with a self-signed certificate made by openssl."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from redis_helpers import chain, ns, payload
from redis_servers import RedisServer, free_port

from promptcache.errors import TierError
from promptcache.tiers.redis import RedisTier

OPENSSL = shutil.which("openssl")


def make_certs(d: Path) -> None:
    assert OPENSSL is not None

    def run(*args: str) -> None:
        subprocess.run([OPENSSL, *args], check=True, capture_output=True, cwd=d)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
        "-days", "1", "-subj", "/CN=promptcache-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "srv.key", "-out", "srv.csr",
        "-subj", "/CN=127.0.0.1")
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "srv.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "srv.crt", "-days", "1", "-extfile", "ext.cnf")


@pytest.mark.skipif(OPENSSL is None, reason="openssl is not installed")
def test_rediss_url(make_tier: Callable[..., RedisTier], tmp_path: Path) -> None:
    make_certs(tmp_path)
    tls_port = free_port()
    srv = RedisServer(tmp_path / "tls", "--tls-port", str(tls_port),
                      "--tls-cert-file", str(tmp_path / "srv.crt"),
                      "--tls-key-file", str(tmp_path / "srv.key"),
                      "--tls-ca-cert-file", str(tmp_path / "ca.crt"),
                      "--tls-auth-clients", "no")
    try:
        srv.start()  # plain port for readiness; the tier uses TLS only
    except RuntimeError as e:  # a build without TLS support
        pytest.skip(f"redis-server without TLS: {e}")
    try:
        url = f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={tmp_path / 'ca.crt'}"
        tier = make_tier(url, timeout_s=2.0, connect_timeout_s=2.0)
        space = ns()
        metas = chain(space, list(range(8)))
        for m in metas:
            assert tier.put(m, payload(m))
        assert tier.flush(timeout=30)
        assert tier.stats()["writes"] == 2
        assert tier.get_metas([m.block_hash for m in metas], ns=space) == metas
        assert tier.get_many([m.block_hash for m in metas], ns=space) == [
            (payload(m), []) for m in metas]
        assert srv.client().dbsize() > 0  # what went over TLS is in this server
        untrusted = make_tier(f"rediss://127.0.0.1:{tls_port}/0", timeout_s=2.0,
                              connect_timeout_s=2.0, start_prober=False)
        with pytest.raises(TierError, match="redis lookup failed"):  # certificate not trusted
            untrusted.get_metas([metas[0].block_hash], ns=space)
    finally:
        srv.stop()
