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
    assert s.matched is None and not s.stopped


def test_stop_strings_record_which_one_matched():
    s = StopStrings(["STOP", "END"])
    assert s.matched is None
    assert s.feed("abc EN") == "abc "
    assert s.feed("D STOP") == "" and s.stopped
    assert s.matched == "END" and s.text == "abc "
    # both in one delta: the earliest match wins, whichever is listed first
    s = StopStrings(["STOP", "END"])
    assert s.feed("x END y STOP") == "x " and s.matched == "END"
    # same position: the first listed wins
    s = StopStrings(["ENDS", "END"])
    assert s.feed("a ENDS") == "a " and s.matched == "ENDS"


@pytest.fixture(scope="module")
def llama(engine_factory, tiny_llama_path):
    return engine_factory(tiny_llama_path)


def test_generation_result_reports_the_stop_sequence(llama):
    prompt = [5, 17, 230, 99, 4, 310, 8, 77]
    ref = llama.generate(prompt, max_tokens=8, use_cache=False)
    assert ref.finish_reason == "length" and ref.stop_sequence is None
    text = ref.text
    assert len(text) > 4
    stop = text[2:4]
    res = llama.generate(prompt, max_tokens=8, stop=["never-in-output", stop], use_cache=False)
    assert res.finish_reason == "stop"
    assert res.stop_sequence == stop
    assert res.text == text[: text.find(stop)]
    # a stop token id is not a stop sequence
    res = llama.generate(prompt, max_tokens=8, stop_token_ids=[ref.tokens[3]], use_cache=False)
    assert res.finish_reason == "stop" and res.stop_sequence is None


def test_stop_strings_scan_only_the_new_tail():
    """32K deltas: each feed looks at (longest stop - 1) + len(delta) characters."""
    scanned: list[int] = []

    class Counting(StopStrings):
        def _scan(self, window):
            scanned.append(len(window))
            return super()._scan(window)

    s = Counting(["<|end|>", "STOP"])
    out = [s.feed(f"w{i % 10} ") for i in range(32_000)]
    assert max(scanned) <= 6 + 4 and len(s._tail) == 6
    assert "".join(out) + s.flush() == s.text == "".join(f"w{i % 10} " for i in range(32_000))
    assert s.feed("ab<|en") == "ab" and s.feed("d|> tail") == "" and s.matched == "<|end|>"
    assert s.text.endswith("w9 ab")


def test_top_k_and_logprob_arrays():
    logits = mx.log(mx.array([0.1, 0.6, 0.3]))
    s = Sampler(SamplingParams(temperature=1.0, top_k=2, seed=3, logprobs=2))
    assert {s(logits) for _ in range(100)} == {1, 2}
    tok = mx.array(1)
    chosen, ids, vals = s.logprob_arrays(logits, tok)
    assert float(chosen.item()) == pytest.approx(float(mx.log(mx.array(0.6)).item()), abs=1e-6)
    assert ids.tolist() == [1, 2]
    assert vals.tolist() == pytest.approx([float(mx.log(mx.array(0.6)).item()),
                                           float(mx.log(mx.array(0.3)).item())], abs=1e-6)


def test_detokenizer_uses_mlx_lms_streaming_detokenizer(llama):
    from mlx_lm.tokenizer_utils import StreamingDetokenizer

    d = Detokenizer(llama.tokenizer)
    assert isinstance(d._stream, StreamingDetokenizer)
    ids = llama.tokenizer.encode("hello world, é and €!", add_special_tokens=False)
    text = "".join(d.add(t) for t in ids) + d.flush()
    assert text == d.text == "hello world, é and €!"
