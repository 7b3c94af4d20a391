"""The memory governor (engine/governor.py): the reclaim order step by step with injected
footprints, what admission does under pressure, and an engine that refuses new work past
the hard watermark and serves again once the footprint is back."""

from __future__ import annotations

import math
import sys
import time

import mlx.core as mx
import numpy as np
import psutil  # type: ignore[import-untyped]
import pytest
from conftest import make_engine

from promptcache.engine import memory as memory_module
from promptcache.engine.api import GenerationRequest, SamplingParams
from promptcache.engine.governor import PAUSE, REFUSE, Holder, MemoryGovernor, trim_heap
from promptcache.engine.requests.admission import Admission, Ticket
from promptcache.errors import OverloadedError


class Memory:
    """A process whose footprint is ``base`` plus what each holder holds; a holder gives
    back what it is asked for (up to what it holds), or everything (``whole``)."""

    def __init__(self, base: int, **held: int) -> None:
        self.base = base
        self.held = dict(held)
        self.asked: list[tuple[str, float]] = []

    def footprint(self) -> int:
        return self.base + sum(self.held.values())

    def holder(self, name: str, *, whole: bool = False, key: str | None = None) -> Holder:
        key = key or name

        def release(n: float) -> int:
            self.asked.append((name, n))
            give = self.held[key] if whole else min(self.held[key], int(n))
            self.held[key] -= give
            return give

        return Holder(name, release)


def governor(mem: Memory, **kw: object) -> tuple[MemoryGovernor, list[tuple[str, int]]]:
    told: list[tuple[str, int]] = []
    holders = [mem.holder("live", whole=True), mem.holder("ram")]
    g = MemoryGovernor(1000, mem.footprint, holders,
                       pool=mem.holder("mlx_cache", whole=True, key="pool"),
                       admission=lambda level, retry: told.append((level, retry)),
                       **kw)  # type: ignore[arg-type]
    return g, told


def test_under_the_soft_watermark_nothing_is_asked():
    mem = Memory(700, pool=30, live=100, ram=10)
    g, told = governor(mem)
    d = g.check()
    assert (d.footprint, d.after, d.released, d.level) == (840, 840, (), "ok")
    assert mem.asked == [] and told == [("ok", 0)]


def test_reclaim_order_pool_then_live_then_ram_each_asked_for_what_is_left():
    # (the pool is asked again after a holder only when that holder released something)
    mem = Memory(700, pool=30, live=100, ram=200)  # 1030 of 1000; soft 850, hard 950
    g, told = governor(mem)
    d = g.check()
    # the pool first (all 30), then the live states (all 100), then 50 of the RAM tier
    assert mem.asked == [("mlx_cache", 180), ("live", 150), ("mlx_cache", 50), ("ram", 50)]
    assert d.released == (("mlx_cache", 30), ("live", 100), ("mlx_cache", 0), ("ram", 50))
    assert (d.footprint, d.after, d.level) == (1030, 850, "ok")
    assert mem.held == {"pool": 0, "live": 0, "ram": 150}
    assert told == [("ok", 0)]
    assert g.stats.released == {"mlx_cache": 30, "live": 100, "ram": 50}


def test_what_the_releases_leave_in_the_pool_is_cleared_last():
    mem = Memory(700, pool=0, live=100, ram=200)

    def live_release(n: float) -> int:  # freed arrays go to MLX's pool, not the OS
        mem.held["live"] -= 100
        mem.held["pool"] += 100
        return 100

    d = MemoryGovernor(1000, mem.footprint, [Holder("live", live_release), mem.holder("ram")],
                       pool=mem.holder("mlx_cache", whole=True, key="pool")).check()
    # live's 100 bytes went to the pool: cleared at once, the RAM tier gives the other 50
    assert d.released == (("mlx_cache", 0), ("live", 100), ("mlx_cache", 100), ("ram", 50))
    assert (d.after, d.level) == (850, "ok") and mem.held["ram"] == 150


def test_between_the_watermarks_admission_pauses_past_the_hard_one_it_refuses():
    mem = Memory(900, pool=0, live=0, ram=0)  # nothing to release
    g, told = governor(mem)
    assert g.check().level == PAUSE and told[-1] == (PAUSE, 1)
    mem.base = 960
    assert g.check().level == REFUSE and told[-1] == (REFUSE, 1)
    mem.base = 800
    assert g.check().level == "ok" and told[-1] == ("ok", 0)
    assert (g.stats.paused, g.stats.refused, g.stats.peak_footprint) == (1, 1, 960)


def test_retry_after_comes_from_the_measured_drain_rate():
    now = [0.0]
    mem = Memory(1000, pool=0, live=0, ram=0)
    g, told = governor(mem, clock=lambda: now[0])
    g.check()
    now[0], mem.base = 2.0, 980  # draining 10 B/s; 130 B over the soft mark: 13 s
    assert g.check().retry_after_s == 13
    assert told[-1] == (REFUSE, 13)


def test_the_ram_tier_grows_back_well_under_the_soft_watermark():
    grown = []
    g = MemoryGovernor(1000, lambda: 790, [], regrow=lambda: grown.append(1))
    g.check()  # 790 < 850 - 50: grows back
    g2 = MemoryGovernor(1000, lambda: 820, [], regrow=lambda: grown.append(2))
    g2.check()  # within the margin: not yet
    assert grown == [1]


def test_a_failing_holder_is_skipped_and_counted_nowhere():
    mem = Memory(700, pool=0, live=0, ram=300)

    def broken(n: float) -> int:
        raise RuntimeError("boom")

    g = MemoryGovernor(1000, mem.footprint, [Holder("live", broken), mem.holder("ram")])
    d = g.check()
    assert d.released == (("ram", 150),) and d.level == "ok"


def test_checks_are_spaced_by_the_interval():
    now = [0.0]
    g = MemoryGovernor(1000, lambda: 100, [], interval_s=0.25, clock=lambda: now[0])
    assert g.maybe_check() is not None and g.maybe_check() is None
    now[0] = 0.3
    assert g.maybe_check() is not None and g.stats.checks == 2


def test_bad_limits_are_refused():
    with pytest.raises(ValueError):
        MemoryGovernor(0, lambda: 0, [])
    with pytest.raises(ValueError):
        MemoryGovernor(10, lambda: 0, [], soft=0.9, hard=0.8)


def _admission() -> Admission:
    return Admission(max_active=4, max_queued=4, kv_budget=None, row_bytes=lambda n: n)


def test_admission_under_pause_serves_one_at_a_time_and_refuse_raises_with_retry_after():
    adm = _admission()
    adm.set_pressure("pause")
    a, b = Ticket("a", 10), Ticket("b", 10)
    adm.submit(a)  # nothing active: admitted (an idle engine still serves)
    adm.submit(b)  # a is active: b waits
    assert (a.state, b.state) == ("admitted", "waiting")
    adm.set_pressure("refuse", 7)
    with pytest.raises(OverloadedError) as e:
        adm.submit(Ticket("c", 10))
    assert e.value.retry_after_s == 7
    adm.release(a)
    assert b.state == "admitted"  # nothing active: one at a time, even when refusing
    c = Ticket("c", 10)
    adm.set_pressure("pause")
    adm.submit(c)
    assert c.state == "waiting"  # b is active
    adm.set_pressure("ok")
    assert c.state == "admitted"
    s = adm.snapshot()
    assert (s["memory_pressure"], s["memory_refused_requests"], s["rejected"]) == ("ok", 1, 1)


def test_a_queued_peak_fits_beside_the_running_ones_or_waits():
    mem = Memory(100)
    g, _ = governor(mem)  # limit 1000: hard 950
    g.check()  # footprint 100
    # the larger of (footprint - reclaimable) and (base + running peaks), plus the peak
    assert g.fits(400, base=100, reclaimable=0, running=450)  # 550 + 400 = 950
    assert not g.fits(401, base=100, reclaimable=0, running=450)
    mem.base = 700
    g.check()  # footprint 700: 650 of it reclaimable -> the running peaks decide
    assert g.fits(400, base=100, reclaimable=650, running=450)
    assert not g.fits(400, base=100, reclaimable=100, running=0)  # 600 + 400


def test_a_peak_refused_under_the_soft_mark_retries_when_the_queue_says():
    mem = Memory(500)
    g, _ = governor(mem)  # soft 850, hard 950
    g.check()
    with pytest.raises(OverloadedError) as e:
        g.admit(500, base=100, reclaimable=0, queue_retry_s=12)
    assert e.value.retry_after_s == 12  # not draining: when the running ones are done
    g.admit(450, base=100, reclaimable=0, queue_retry_s=12)  # 500 + 450 = 950 fits


def test_admission_starts_a_queued_ticket_only_when_its_peak_fits_or_alone():
    adm = _admission()
    room = {"free": 100}
    adm.memory_fits = lambda peak, running: running + peak <= room["free"]
    a, b, c = Ticket("a", 10, peak=60), Ticket("b", 10, peak=60), Ticket("c", 10, peak=30)
    adm.submit(a)
    adm.submit(b)  # 60 + 60 > 100: waits although a slot and the KV budget are free
    adm.submit(c)  # behind b in the queue (first come, first served)
    assert (a.state, b.state, c.state) == ("admitted", "waiting", "waiting")
    adm.release(a)
    assert (b.state, c.state) == ("admitted", "admitted")  # 60, then 60 + 30
    d = Ticket("d", 10, peak=500)
    adm.submit(d)
    assert d.state == "waiting"
    adm.release(b)
    adm.release(c)
    assert d.state == "admitted"  # alone: a request always runs when nothing else does
    assert adm.snapshot()["memory_waits"] == 2  # b and d, each counted once


def test_an_engine_past_the_hard_watermark_refuses_and_serves_again(tiny_llama_path):
    eng = make_engine(tiny_llama_path, live_states=2)
    used = [0]
    try:
        g = eng.memory.build(1 << 30, footprint=lambda: used[0])
        eng.memory.governor = g
        prompt = tuple(int(t) for t in np.random.default_rng(3).integers(3, 1000, size=30))
        req = GenerationRequest(prompt_tokens=prompt, sampling=SamplingParams(max_tokens=3))
        first = eng.submit(req).result(timeout=120)
        assert eng.engine_stats()["live_states"] == 1
        used[0] = 1 << 31  # twice the limit: every holder is asked, then new work refused
        d = g.check()
        # the footprint never moves here: every holder gives everything it has
        names = [name for name, _ in d.released]
        assert names[0] == "mlx_cache" and names.index("live") < names.index("ram")
        assert dict(d.released)["live"] > 0 and eng.engine_stats()["live_states"] == 0
        assert eng.cache.stats().ram_bytes == 0  # the RAM tier shrank to nothing
        assert d.level == REFUSE
        with pytest.raises(OverloadedError):
            eng.submit(req)
        used[0] = 1 << 20  # back: the RAM tier's budget grows back, requests are served
        assert g.check().level == "ok"
        assert eng.cache.pool.budget_bytes == 64 * 1024**2
        again = eng.submit(req).result(timeout=120)
        assert again.tokens == first.tokens and again.error is None
        s = eng.engine_stats()
        # refused at submit by its predicted peak (the footprint past the hard mark)
        assert (s["memory_level"], s["memory_refused_peaks"]) == ("ok", 1)
        assert s["memory_limit_bytes"] == 1 << 30 and not math.isnan(s["memory_peak_footprint"])
        # the footprint the last check read (the dashboard's), the arrays and their cap
        assert s["memory_footprint_bytes"] == 1 << 20
        assert (s["ram_arrays"], s["max_arrays"]) == (eng.cache.pool.num_blocks, 400_000)
    finally:
        eng.close()


def test_memory_limit_option():
    import psutil

    from promptcache.cli.serve_cmd import memory_limit

    total = psutil.virtual_memory().total
    assert memory_limit("off") is None and memory_limit("OFF") is None
    assert memory_limit("8GB") == 8 * 1024**3
    assert memory_limit("50%") == total // 2
    with pytest.raises(ValueError):
        memory_limit("0")
    with pytest.raises(ValueError):
        memory_limit("150%")


def test_serve_limits_memory_to_75_percent_by_default():
    from promptcache.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert args.memory_limit == "75%"


def test_admission_predicts_the_peak_never_fits_is_a_400_not_now_a_429(tiny_llama_path):
    import mlx.core as mx

    from promptcache.errors import RequestError

    eng = make_engine(tiny_llama_path)
    try:
        prompt = tuple(int(t) for t in np.random.default_rng(4).integers(3, 1000, size=30))
        req = GenerationRequest(prompt_tokens=prompt, sampling=SamplingParams(max_tokens=3))
        # a limit whose hard watermark the weights alone nearly fill: no request fits, ever
        eng.memory.governor = eng.memory.build(int(eng.memory.weights_bytes / 0.95) + 1, footprint=lambda: 0)
        with pytest.raises(RequestError, match=r"needs about .* GB at its peak .* weights"):
            eng.submit(req)
        # room for it, but the process holds all of the limit and has nothing to release
        limit = 1 << 30
        eng.memory.governor = g = eng.memory.build(limit, footprint=lambda: limit)
        mx.clear_cache()
        g.check()  # the footprint seen: at the limit, past the hard watermark
        with pytest.raises(OverloadedError, match="needs about"):
            eng.submit(req)
        assert g.stats.refused_peaks == 1
        # the footprint back down: served, and the server went on all along
        eng.memory.governor = eng.memory.build(limit, footprint=lambda: 0)
        eng.memory.governor.check()
        r = eng.submit(req).result(timeout=120)
        assert r.error is None and len(r.tokens) == 3
    finally:
        eng.close()


def test_an_idle_engine_keeps_checking_so_it_stops_refusing(tiny_llama_path):
    """Past the hard mark new requests are refused. When the engine is idle nothing
    wakes it, yet it keeps checking the footprint while it refuses: once the footprint
    is down, new requests are taken again (an engine that only checked between steps
    would refuse forever)."""
    eng = make_engine(tiny_llama_path)
    used = [0]
    limit = 1 << 30
    try:
        g = eng.memory.build(limit, footprint=lambda: used[0])
        eng.memory.governor = g
        eng.loop._governor = g  # the loop's checks (between steps and while idle)
        prompt = tuple(int(t) for t in np.random.default_rng(5).integers(3, 1000, size=20))
        req = GenerationRequest(prompt_tokens=prompt, sampling=SamplingParams(max_tokens=2))
        used[0] = limit
        eng.call(g.check)  # on the engine thread, as the loop's own checks run
        with pytest.raises(OverloadedError):
            eng.submit(req)
        used[0] = 0
        deadline = time.monotonic() + 60  # a deadlock guard: the idle loop re-checks
        while g.level != "ok" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert g.level == "ok"
        r = eng.submit(req).result(timeout=60)
        assert r.error is None and len(r.tokens) == 2
    finally:
        eng.close()


def test_the_running_requests_kv_budget_fits_under_the_limit(tiny_llama_path):
    from promptcache.engine.governor import process_footprint

    before = process_footprint()
    limit = before + 200 * 2**20
    eng = make_engine(tiny_llama_path, memory_limit_bytes=limit)
    try:
        # the hard watermark less what the process held once the model was loaded (at
        # least what it held before, give or take what the allocator returned)
        budget = eng.admission.kv_budget
        assert budget is not None and 0 < budget <= int(limit * 0.95) - before + 16 * 2**20
        assert eng.engine_stats()["kv_budget_bytes"] == budget
        # MLX's buffer cache at most an eighth of that room (it refills between checks)
        cache_limit = mx.set_cache_limit(0)
        mx.set_cache_limit(cache_limit)
        assert cache_limit <= budget // 8
    finally:
        eng.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_trim_heap_gives_back_what_glibc_keeps_after_a_free():
    # 200 MB in 100 KB pieces (under glibc's mmap threshold: its heap), the last one kept
    # so the heap's top cannot shrink on its own: freed, RSS stays; trimmed, it drops
    rss = lambda: psutil.Process().memory_info().rss  # noqa: E731
    pieces = [bytearray(100 * 1024) for _ in range(2048)]
    keep = pieces.pop()
    before = rss()
    del pieces
    freed = rss()
    assert before - freed < 32 * 2**20  # glibc kept the memory
    assert trim_heap() is True
    assert before - rss() > 150 * 2**20
    assert len(keep) == 100 * 1024


def test_the_pool_release_trims_the_heap_and_reports_the_footprint_it_freed(
        tiny_llama_path, monkeypatch):
    eng = make_engine(tiny_llama_path)
    try:
        reads = iter([1000, 700])
        trims: list[bool] = []
        monkeypatch.setattr(memory_module, "trim_heap", lambda: trims.append(True) or True)
        g = eng.memory.build(1 << 30, footprint=lambda: next(reads))
        mx.clear_cache()  # MLX's pool holds nothing: what it frees is the trimmed heap
        assert g._pool is not None and g._pool.release(math.inf) == 300
        assert trims == [True]
    finally:
        eng.close()
