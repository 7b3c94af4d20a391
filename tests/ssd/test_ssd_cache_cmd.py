"""`promptcache cache ...` against a real SSD folder."""

import io
import json
import sys

import pytest
from ssd_helpers import NS, NS_BOB, FakeClock, chain, make_tier, payload_for

from promptcache.cli import main
from promptcache.cli.cache_cmd import parse_duration
from promptcache.tiers.ssd_files import block_rel_path


@pytest.fixture
def cache_dir(tmp_path):
    tier = make_tier(tmp_path)
    for i, m in enumerate(chain(NS, 3) + chain(NS_BOB, 2)):
        tier.put(m, payload_for(i))
    tier.close()
    return tmp_path


@pytest.mark.parametrize(
    "text, seconds", [("7d", 604800), ("12h", 43200), ("30m", 1800), ("45s", 45), ("1.5h", 5400)]
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "7", "d", "-1d", "7y", "1 2h"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError):
        parse_duration(text)


def test_stats(cache_dir, capsys):
    assert main(["cache", "stats", "--cache-dir", str(cache_dir)]) == 0
    out = json.loads(capsys.readouterr().out)
    size = len(payload_for(0))
    assert out["blocks"] == 5 and out["bytes"] == 5 * size
    assert out["tenants"] == {
        "alice": {"blocks": 3, "bytes": 3 * size},
        "bob": {"blocks": 2, "bytes": 2 * size},
    }


def test_ls(cache_dir, capsys):
    assert main(["cache", "ls", "--tenant", "bob", "--cache-dir", str(cache_dir)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and lines[0].startswith("hash")
    hashes = {m.block_hash.hex()[:16] for m in chain(NS_BOB, 2)}
    assert {ln.split()[0] for ln in lines[1:]} == hashes


def test_check_exit_codes(cache_dir, capsys):
    assert main(["cache", "check", "--cache-dir", str(cache_dir)]) == 0
    m = chain(NS, 3)[1]
    (cache_dir / block_rel_path(m.namespace_key, m.tenant, m.block_hash.hex())).unlink()
    assert main(["cache", "check", "--cache-dir", str(cache_dir)]) == 1
    assert main(["cache", "check", "--cache-dir", str(cache_dir)]) == 1  # nothing was fixed
    capsys.readouterr()
    assert main(["cache", "check", "--fix", "--cache-dir", str(cache_dir)]) == 0
    assert json.loads(capsys.readouterr().out)["missing_files"] == 1
    assert main(["cache", "check", "--cache-dir", str(cache_dir)]) == 0


def test_purge_tenant(cache_dir, capsys):
    assert main(["cache", "purge", "--tenant", "bob", "--yes", "--cache-dir", str(cache_dir)]) == 0
    assert capsys.readouterr().out.strip() == "purged 2 block(s)"
    tier = make_tier(cache_dir)
    assert [t for t, _, _ in tier.tenants()] == ["alice"]
    tier.close()


def test_purge_older_than(tmp_path, capsys):
    clock = FakeClock(1_000_000.0)  # long ago
    tier = make_tier(tmp_path, clock=clock)
    old = chain(NS, 2)
    for i, m in enumerate(old):
        tier.put(m, payload_for(i))
    tier.close()
    tier = make_tier(tmp_path)  # real clock: now
    new = chain(NS_BOB, 1)[0]
    tier.put(new, payload_for(5))
    tier.close()
    size = len(payload_for(0))
    purge = ["cache", "purge", "--older-than", "7d", "--cache-dir", str(tmp_path)]
    assert main([*purge, "--dry-run"]) == 0
    assert capsys.readouterr().out == (f"would purge 2 block(s) ({2 * size} bytes); "
                                       "nothing deleted (--dry-run)\n")
    assert _blocks(tmp_path) == 3
    assert main([*purge, "--yes"]) == 0
    assert capsys.readouterr().out.strip() == "purged 2 block(s)"
    tier = make_tier(tmp_path)
    assert [r.meta for r in tier.rows()] == [new]
    tier.close()


class _Stdin(io.StringIO):
    """stdin with what the user types; a terminal or not."""

    def __init__(self, text: str, *, tty: bool) -> None:
        super().__init__(text)
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def _blocks(cache_dir) -> int:
    tier = make_tier(cache_dir, read_only=True)
    try:
        return len(tier.rows())
    finally:
        tier.close()


def test_purge_dry_run_deletes_nothing(cache_dir, capsys):
    size = len(payload_for(0))
    assert main(["cache", "purge", "--dry-run", "--cache-dir", str(cache_dir)]) == 0
    assert capsys.readouterr().out == (f"would purge 5 block(s) ({5 * size} bytes); "
                                       "nothing deleted (--dry-run)\n")
    assert main(["cache", "purge", "--dry-run", "--tenant", "bob",
                 "--cache-dir", str(cache_dir)]) == 0
    assert capsys.readouterr().out == (f"would purge 2 block(s) ({2 * size} bytes); "
                                       "nothing deleted (--dry-run)\n")
    assert _blocks(cache_dir) == 5


def test_purge_off_a_terminal_needs_yes(cache_dir, capsys, monkeypatch):
    size = len(payload_for(0))
    monkeypatch.setattr(sys, "stdin", _Stdin("y\n", tty=False))  # a pipe: never read
    assert main(["cache", "purge", "--tenant", "bob", "--cache-dir", str(cache_dir)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"promptcache: error: cache purge would delete 2 block(s) "
                            f"({2 * size} bytes) from {cache_dir} and stdin is not a terminal "
                            "to confirm: pass --yes (or --dry-run)\n")
    assert _blocks(cache_dir) == 5
    with pytest.raises(SystemExit) as exit_:  # one or the other
        main(["cache", "purge", "--yes", "--dry-run", "--cache-dir", str(cache_dir)])
    assert exit_.value.code == 2


@pytest.mark.parametrize("answer, deleted", [("y\n", True), ("YES\n", True), ("n\n", False),
                                             ("\n", False), ("", False)])
def test_purge_on_a_terminal_asks(cache_dir, capsys, monkeypatch, answer, deleted):
    size = len(payload_for(0))
    monkeypatch.setattr(sys, "stdin", _Stdin(answer, tty=True))
    rc = main(["cache", "purge", "--tenant", "bob", "--cache-dir", str(cache_dir)])
    captured = capsys.readouterr()
    question = f"delete 2 block(s) ({2 * size} bytes) from {cache_dir}? [y/N] "
    if deleted:
        assert (rc, captured.out, captured.err) == (0, "purged 2 block(s)\n", question)
        assert _blocks(cache_dir) == 3
    else:
        assert (rc, captured.out) == (1, "")
        assert captured.err == question + "promptcache cache purge: nothing deleted\n"
        assert _blocks(cache_dir) == 5


def test_bad_arguments_exit_2(tmp_path, capsys):
    assert main(["cache", "purge", "--older-than", "soon", "--cache-dir", str(tmp_path)]) == 2
    assert main(["cache", "stats", "--cache-dir", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
