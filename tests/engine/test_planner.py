"""The restore-or-recompute planner (engine/payload/planner.py) with injected rates: exact block
boundaries and predicted times, the stateful rule, forced policies, the online fits."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from promptcache.engine.payload.planner import Fit, Plan, Planner, Rates, Span, plan


class Fixed(Fit):
    """A fit with fixed coefficients (an injected rate)."""

    def __init__(self, a: float, b: float) -> None:
        super().__init__(0)
        self.ab = (a, b)
        self.samples = 1

    def add(self, x1: float, x2: float, y: float) -> None:
        pass

    def coef(self) -> tuple[float, float]:
        return self.ab


def rates(per_token: float, per_pos: float = 0.0, reads: dict[str, tuple[float, float]]
          | None = None, restore: tuple[float, float] = (0.0, 0.0),
          split: dict[str, tuple[float, float]] | None = None) -> Rates:
    return Rates(prefill=Fixed(per_token, per_pos),
                 reads={t: Fixed(*ab) for t, ab in (reads or {}).items()},
                 restore=Fixed(*restore),
                 split={t: Fixed(*ab) for t, ab in (split or {}).items()})


def blocks(*tiers: str, size: int = 64, nbytes: int = 1000) -> list[Span]:
    return [Span(t, i * size, (i + 1) * size, nbytes) for i, t in enumerate(tiers)]


def test_all_ram_needs_no_plan():
    assert plan(blocks("ram", "ram"), rates(1.0)) is None
    assert plan([], rates(1.0)) is None


def test_a_slow_tier_is_recomputed_from_the_ram_head_on():
    # 2 RAM blocks, 3 SSD blocks of 1,000 bytes; SSD: 0.01 s per read + 1 ms per byte
    # -> 0.01 + 3.0 s; prefill 1 ms per token -> 192 tokens 0.192 s
    r = rates(1e-3, reads={"ssd": (0.01, 1e-3)})
    p = plan(blocks("ram", "ram", "ssd", "ssd", "ssd"), r)
    assert p == Plan("recompute", "auto", 128, 320, 320, load_s=pytest.approx(3.01),
                     recompute_s=pytest.approx(0.192), split_s=None)
    assert p is not None and p.keep == 128 and p.predicted_s == pytest.approx(0.192)


def test_a_fast_tier_is_loaded():
    r = rates(1e-3, reads={"ssd": (0.001, 1e-7)})
    p = plan(blocks("ssd", "ssd", "ssd", "ssd"), r)
    assert p is not None and (p.kind, p.head, p.split, p.end, p.keep) == ("load", 0, 0, 256, 256)
    assert p.load_s == pytest.approx(0.001 + 4000e-7)
    assert p.recompute_s == pytest.approx(0.256)


def test_prefill_cost_grows_with_the_position():
    # per token 1e-3 + 1e-5 * position: tokens [64, 192) cost
    # 128 * 1e-3 + 1e-5 * (64 + ... + 191) = 0.128 + 1e-5 * 16320
    r = rates(1e-3, 1e-5, reads={"ssd": (0.0, 1.0)})
    p = plan(blocks("ram", "ssd", "ssd"), r)
    assert p is not None and p.kind == "recompute"
    assert p.recompute_s == pytest.approx(0.128 + 0.1632)
    assert r.prefill_s(64, 192) == pytest.approx(0.128 + 0.1632)


def test_one_read_latency_per_run_of_a_tier_and_restore_costs_counted():
    # runs: ssd ssd | redis | ssd: three reads; restore 0.5 ms per block + 1 us per byte
    r = rates(1.0, reads={"ssd": (0.1, 0.0), "redis": (0.2, 0.0)}, restore=(5e-4, 1e-6))
    p = plan(blocks("ssd", "ssd", "redis", "ssd"), r)
    assert p is not None and p.kind == "load"
    assert p.load_s == pytest.approx(0.1 + 0.2 + 0.1 + 4 * (5e-4 + 1e-3))


def test_the_split_meets_in_the_middle_when_the_engine_can_run_it():
    # 10 SSD blocks of 64 tokens: prefill 1 ms per token (64 ms a block), SSD 64 ms a
    # block: load-only 0.64 s, recompute-only 0.64 s, the split at block 5: 0.32 s
    r = rates(1e-3, reads={"ssd": (0.0, 64e-6)})
    spans = blocks(*["ssd"] * 10)
    p = plan(spans, r, concurrent=True)
    assert p is not None and (p.kind, p.head, p.split, p.end) == ("split", 0, 320, 640)
    assert p.split_s == pytest.approx(0.32)
    assert p.overlap == (pytest.approx(0.32), pytest.approx(0.32))  # (min, max + restore)
    assert p.load_s == pytest.approx(0.64) and p.recompute_s == pytest.approx(0.64)
    assert p.keep == 0
    # without a concurrent engine only load-only and recompute-only are candidates
    # a tail of two tiers: the split only inside the last tier's run
    mixed = plan(blocks(*["redis"] * 7, *["ssd"] * 3), rates(
        1e-3, reads={"ssd": (0.0, 64e-6), "redis": (0.0, 64e-6)}), concurrent=True)
    assert mixed is not None and (mixed.kind, mixed.split) == ("split", 448)
    assert mixed.split_s == pytest.approx(0.448)
    q = plan(spans, rates(1e-3, reads={"ssd": (0.0, 63e-6)}))
    assert q is not None and (q.kind, q.split, q.split_s) == ("load", 0, None)
    q = plan(spans, rates(1e-3, reads={"ssd": (0.0, 65e-6)}))
    assert q is not None and (q.kind, q.split, q.split_s) == ("recompute", 640, None)


def test_the_splits_measured_overlap_decides_whether_it_is_taken():
    """A split's time: contention * min(head, read) + scale * (max(head, read) + restore)
    of the tail's tier (injected here): 10 SSD blocks, prefill 64 ms a block, the SSD
    63 ms: load-only 0.63 s, recompute-only 0.64 s, a free split at block 5 0.32 s."""
    spans = blocks(*["ssd"] * 10)

    def with_split(split: dict[str, tuple[float, float]]) -> Plan | None:
        return plan(spans, rates(1e-3, reads={"ssd": (0.0, 63e-6)}, split=split),
                    concurrent=True)

    # half the overlap lost: the middle still wins, 0.32 + 0.5 * 0.315
    p = with_split({"ssd": (0.5, 1.0)})
    assert p is not None and (p.kind, p.split) == ("split", 320)
    assert p.split_s == pytest.approx(0.4775)
    assert p.overlap == (pytest.approx(0.315), pytest.approx(0.32))
    # one after the other: 0.631 s at best (split at 64), slower than load-only
    p = with_split({"ssd": (1.0, 1.0)})
    assert p is not None and (p.kind, p.split, p.overlap) == ("load", 0, None)
    assert p.load_s == pytest.approx(0.63) and p.split_s == pytest.approx(0.631)
    # the rest twice as slow as predicted: the best split 0.64 s, slower too
    p = with_split({"ssd": (0.0, 2.0)})
    assert p is not None and p.kind == "load" and p.split_s == pytest.approx(0.64)
    # another tier's fit does not apply to the SSD's tail
    p = with_split({"redis": (1.0, 1.0)})
    assert p is not None and (p.kind, p.split_s) == ("split", pytest.approx(0.32))


def test_the_overlap_is_learned_from_measured_splits():
    r = Rates()
    assert r.split_s("ssd", 0.2, 0.3, 0.1) == pytest.approx(0.4)  # unmeasured: free
    # one sample: the measured / predicted ratio scales the whole prediction
    r.record_split("ssd", (0.2, 0.4), 0.6)
    assert r.split["ssd"].coef() == (0.0, pytest.approx(1.5))
    assert r.split_s("ssd", 0.2, 0.3, 0.1) == pytest.approx(0.6)
    # splits that ran one after the other (min + max + restore), of several shapes:
    # contention 1, scale 1 exactly once they can be told apart
    s = Rates()
    for lo, hi in ((0.1, 0.5), (0.3, 0.4), (0.05, 0.9)):
        s.record_split("redis", (lo, hi), lo + hi)
    assert s.split["redis"].coef() == (pytest.approx(1.0), pytest.approx(1.0))
    assert s.split_s("redis", 0.2, 0.3, 0.1) == pytest.approx(0.6)
    assert s.snapshot()["split"] == {"redis": {"samples": 3, "contention": pytest.approx(1.0),
                                               "scale": pytest.approx(1.0)}}
    # learned online, the planner stops choosing a split that lost to load-only
    spans = blocks(*["ssd"] * 10)
    learned = rates(1e-3, reads={"ssd": (0.0, 63e-6)})  # load-only 0.63 s
    first = plan(spans, learned, concurrent=True)
    assert first is not None and (first.kind, first.split_s) == ("split", pytest.approx(0.32))
    assert first.overlap is not None
    learned.record_split("ssd", first.overlap, 0.70)  # measured: slower than load-only
    again = plan(spans, learned, concurrent=True)
    assert again is not None and again.kind == "load"
    assert again.split_s == pytest.approx(0.70)  # the same split, scaled by 0.70 / 0.32


def test_stateful_caches_load_only_whatever_the_rates_or_policy():
    r = rates(1e-9, reads={"ssd": (1.0, 1.0)})
    for policy in ("auto", "recompute"):
        p = plan(blocks("ram", "ssd"), r, policy=policy, qualifies=False, concurrent=True)
        assert p == Plan("load", "stateful", 64, 64, 128)
        assert p.keep == 128


def test_forced_policies_and_unmeasured_rates():
    spans = blocks("ram", "ssd", "ssd")
    assert plan(spans, Rates(), policy="recompute") == Plan("recompute", "forced", 64, 192, 192)
    assert plan(spans, Rates(), policy="load") == Plan("load", "forced", 64, 64, 192)
    # no measurement yet: load (and measure the tier)
    assert plan(spans, Rates()) == Plan("load", "unmeasured", 64, 64, 192)
    assert plan(spans, rates(1.0)) == Plan("load", "unmeasured", 64, 64, 192)
    with pytest.raises(ValueError, match="policy must be one of"):
        plan(spans, Rates(), policy="fast")
    with pytest.raises(ValueError, match="restore plan must be one of"):
        Planner("fast")


def test_the_planner_cuts_a_partial_last_block_at_the_tokens_asked():
    class Meta:
        def __init__(self, start: int, end: int) -> None:
            self.start, self.end, self.nbytes = start, end, 100

    class M:
        num_tokens = 150
        blocks = [Meta(0, 64), Meta(64, 128), Meta(128, 192)]
        tiers = ["ram", "ssd", "ssd"]

    pl = Planner("recompute")
    assert pl.decide(M()) == Plan("recompute", "forced", 64, 150, 150)
    assert pl.decide(M(), 100) == Plan("recompute", "forced", 64, 100, 100)
    assert pl.decide(M(), 64) is None


def test_describe_and_to_dict():
    p = Plan("recompute", "auto", 128, 4096, 4096, 0.92, 0.31, None)
    assert p.describe() == "recompute/auto[128:4096:4096],load=0.920s,recompute=0.310s"
    assert p.to_dict() == {"kind": "recompute", "why": "auto", "load_tokens": 128,
                           "recompute": [128, 4096], "tail_load": [4096, 4096],
                           "predicted_s": {"load": 0.92, "recompute": 0.31, "split": None}}


def test_the_fits_recover_exact_linear_rates():
    r = Rates()
    # prefill: 2 ms per token + 1 us per token-position, chunks of 64 at several positions
    for start in (0, 64, 128, 512, 1024):
        n = 64
        r.record_prefill([(start, n)], n * 2e-3 + 1e-6 * (n * start + n * (n - 1) / 2))
    a, b = r.prefill.coef() or (0, 0)
    assert a == pytest.approx(2e-3) and b == pytest.approx(1e-6)
    assert r.prefill_s(0, 64) == pytest.approx(64 * 2e-3 + 1e-6 * 2016)
    # a batch's forward (rows at several positions) is one sample of the same model
    rb = Rates()
    for rows in ([(0, 32), (100, 16)], [(512, 32), (0, 8)], [(2048, 4), (64, 64)]):
        rb.record_prefill(rows, sum(n * 2e-3 + 1e-6 * (n * p + n * (n - 1) / 2)
                                    for p, n in rows))
    assert rb.prefill.coef() == (pytest.approx(2e-3), pytest.approx(1e-6))
    # a tier: 5 ms per read + 1 ns per byte
    for nbytes in (1 << 20, 4 << 20, 16 << 20):
        r.record_read("ssd", 1, nbytes, 5e-3 + nbytes * 1e-9)
    lat, per_byte = r.reads["ssd"].coef() or (0, 0)
    assert lat == pytest.approx(5e-3) and per_byte == pytest.approx(1e-9)
    # every read the same size: the bytes alone (primary) carry it
    one = Fit(1)
    for _ in range(3):
        one.add(1, 1000, 0.5)
    assert one.coef() == (0.0, pytest.approx(5e-4))
    # nonsense samples are ignored
    one.add(1, 1000, float("nan"))
    one.add(1, -1, 0.5)
    assert one.samples == 3
    snap = r.snapshot()
    assert snap["reads"]["ssd"]["samples"] == 3 and snap["prefill"]["samples"] == 5


TIERS = st.sampled_from(["ram", "ssd", "redis"])


@settings(max_examples=300, deadline=None)
@given(tiers=st.lists(TIERS, min_size=1, max_size=40),
       nbytes=st.integers(1, 1 << 22),
       per_token=st.floats(1e-7, 1e-1), per_pos=st.floats(0, 1e-5),
       ssd=st.tuples(st.floats(0, 0.1), st.floats(1e-12, 1e-6)),
       redis=st.tuples(st.floats(0, 0.1), st.floats(1e-12, 1e-6)),
       restore=st.tuples(st.floats(0, 1e-3), st.floats(0, 1e-8)),
       split=st.one_of(st.none(), st.tuples(st.floats(0, 2), st.floats(0.1, 3))),
       concurrent=st.booleans())
def test_the_chosen_plan_is_never_predicted_slower_than_load_or_recompute_alone(
        tiers, nbytes, per_token, per_pos, ssd, redis, restore, split, concurrent):
    r = rates(per_token, per_pos, {"ssd": ssd, "redis": redis}, restore,
              split={"ssd": split, "redis": split} if split else None)
    spans = blocks(*tiers, nbytes=nbytes)
    p = plan(spans, r, concurrent=concurrent)
    if all(t == "ram" for t in tiers):
        assert p is None
        return
    assert p is not None and p.load_s is not None and p.recompute_s is not None
    chosen = p.predicted_s
    assert chosen is not None and chosen <= min(p.load_s, p.recompute_s) + 1e-12
    # the plan's boundaries are block boundaries: the RAM head, then the split
    starts = {s.start for s in spans} | {spans[-1].end}
    assert p.head in starts and p.split in starts and p.head <= p.split <= p.end
    assert all(s.tier == "ram" for s in spans if s.end <= p.head)
    assert (p.kind == "split") == (p.head < p.split < p.end and concurrent)
    if p.kind == "split":  # the tail is one lower tier's blocks
        assert len({s.tier for s in spans if s.start >= p.split}) == 1
        assert spans[-1].tier != "ram"
    if not concurrent:
        assert p.split_s is None
    assert (p.overlap is not None) == (p.kind == "split")


def test_a_load_re_measures_the_tier_after_sixteen_recomputes_in_a_row():
    """Recompute keeps winning, so the tier is never read and its rate never updated:
    every 17th decision in a row is a load (``probe``), then the count starts again; a
    load or split chosen on its own merits resets it too."""
    from promptcache.engine.payload.planner import PROBE_EVERY

    class Meta:
        def __init__(self, start: int, end: int) -> None:
            self.start, self.end, self.nbytes = start, end, 1000

    class M:
        num_tokens = 192
        blocks = [Meta(0, 64), Meta(64, 128), Meta(128, 192)]
        tiers = ["ram", "ssd", "ssd"]

    pl = Planner("auto")
    pl.rates = rates(1e-3, reads={"ssd": (0.01, 1e-3)})  # the SSD: 2.01 s, recompute 0.128 s
    kinds = [(p.kind, p.why, p.split) for p in (pl.decide(M()) for _ in range(2 * PROBE_EVERY + 2))
             if p is not None]
    want = [("recompute", "auto", 192)] * PROBE_EVERY + [("load", "probe", 64)]
    assert kinds == want * 2
    assert pl.recomputes == 0
    pl.decide(M())
    assert pl.recomputes == 1
    pl.rates = rates(1e-3, reads={"ssd": (0.001, 1e-7)})  # now a load wins on its merits
    p = pl.decide(M())
    assert p is not None and (p.kind, p.why) == ("load", "auto") and pl.recomputes == 0
