"""Sampling, incremental detokenization and stop-string hold-back (no model needed)."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import pytest

from promptcache.engine.api import SamplingParams
from promptcache.engine.sampling import Detokenizer, Sampler, StopStrings


def test_greedy_and_top_p():
    logits = mx.log(mx.array([0.5, 0.3, 0.15, 0.05]))
    assert Sampler(SamplingParams())(logits) == 0
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.7, seed=1))
    counts = Counter(s(logits) for _ in range(200))
    assert set(counts) == {0, 1}  # 0.5 + 0.3 reaches 0.7: tokens 2 and 3 are cut
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.4, seed=1))
    assert {s(logits) for _ in range(50)} == {0}
    full = Counter(Sampler(SamplingParams(temperature=1.0, seed=2))(logits) for _ in range(1))
    assert sum(full.values()) == 1


def test_seeded_streams_are_independent():
    logits = mx.zeros((50,))
    a = Sampler(SamplingParams(temperature=1.0, seed=11))
    b = Sampler(SamplingParams(temperature=1.0, seed=11))
    other = Sampler(SamplingParams(temperature=1.0, seed=12))
    seq_a = []
    for _ in range(10):
        seq_a.append(a(logits))
        other(logits)  # interleaved use of another request's sampler
    assert seq_a == [b(logits) for _ in range(10)]
    with pytest.raises(ValueError, match="seed"):
        Sampler(SamplingParams(temperature=1.0, seed=-1))


class _ByteTok:
    """Token i is byte i (UTF-8 multi-byte characters span several tokens)."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_detokenizer_never_emits_partial_characters():
    d = Detokenizer(_ByteTok())
    text = "aé€b"
    deltas = [d.add(b) for b in text.encode("utf-8")]
    assert deltas == ["a", "", "é", "", "", "€", "b"]
    assert d.text == text and d.flush() == ""
    d = Detokenizer(_ByteTok())
    assert d.add(0xE2) == "" and d.flush() == "\ufffd"


def test_stop_strings_hold_back_partial_matches():
    s = StopStrings(["END"])
    assert s.feed("hello E") == "hello "
    assert s.feed("N") == ""
    assert s.feed("x") == "ENx"
    assert s.feed(" bye EN") == " bye "
    assert s.feed("D more") == "" and s.stopped
    assert s.text == "hello ENx bye "
    s = StopStrings(["END"])
    s.feed("abc EN")
    assert s.flush() == "EN" and s.text == "abc EN"
