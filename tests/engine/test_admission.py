"""Admission control (pure Python): limits, the bounded queue, KV bytes, priorities."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from promptcache.engine.admission import ADMITTED, CANCELLED, TAKEN, WAITING, Admission, Ticket
from promptcache.errors import OverloadedError, RequestError


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _adm(max_active=2, max_queued=2, budget=None, per_token=10, clock=None):
    return Admission(max_active, max_queued, budget, lambda n: n * per_token,
                     clock=clock or Clock())


def test_admit_queue_then_refuse_with_retry_after():
    clock = Clock()
    a = _adm(clock=clock)
    t = [Ticket(i, 10) for i in range(5)]
    a.submit(t[0])
    a.submit(t[1])
    assert [x.state for x in t[:2]] == [ADMITTED, ADMITTED]
    a.submit(t[2])
    a.submit(t[3])
    assert t[2].state == t[3].state == WAITING
    with pytest.raises(OverloadedError) as e:
        a.submit(t[4])
    assert e.value.retry_after_s >= 1
    assert t[4].state == CANCELLED
    snap = a.snapshot()
    assert (snap["active"], snap["queued"], snap["rejected"], snap["queued_total"]) == (2, 2, 1, 2)
    assert [x.item for x in a.take()] == [0, 1]
    clock.t += 4.0
    a.release(t[0])  # FIFO: the oldest waiter gets the slot
    assert t[2].state == ADMITTED and t[2].queue_s == pytest.approx(4.0)
    assert t[3].state == WAITING
    assert [x.item for x in a.take()] == [2]
    assert a.snapshot()["wait_s_max"] == pytest.approx(4.0)
    # the Retry-After estimate follows the service times seen so far
    assert a.stats.recent_service_s == pytest.approx(4.0)
    assert a.retry_after_s() == 4  # (1 waiting + 1) / 2 slots x 4 s


def test_kv_budget_charges_the_padded_batch():
    a = _adm(max_active=8, max_queued=4, budget=1000)
    big, mid, small = Ticket("big", 50), Ticket("mid", 40), Ticket("small", 10)
    a.submit(big)  # 1 x 500
    a.submit(mid)  # 2 x 500 = 1000: fits exactly
    a.submit(small)  # 3 x 500 > 1000: every row is padded to the longest
    assert (big.state, mid.state, small.state) == (ADMITTED, ADMITTED, WAITING)
    assert a.snapshot()["kv_reserved_bytes"] == 1000
    a.release(big)  # now 2 x 400 = 800
    assert small.state == ADMITTED and a.snapshot()["kv_reserved_bytes"] == 800
    with pytest.raises(RequestError, match="more than the active-KV budget"):
        a.submit(Ticket("huge", 101))


def test_background_waits_for_interactive_and_leaves_a_slot():
    a = _adm(max_active=2, max_queued=4)
    bg1 = Ticket("bg1", 1, background=True)
    a.submit(bg1)
    bg2 = Ticket("bg2", 1, background=True)
    a.submit(bg2)  # would take the last free slot: waits
    assert (bg1.state, bg2.state) == (ADMITTED, WAITING)
    ia = [Ticket(f"ia{i}", 1) for i in range(2)]
    for t in ia:
        a.submit(t)
    assert [t.state for t in ia] == [ADMITTED, WAITING]  # the free slot was for it
    a.release(bg1)  # an interactive waiter goes first
    assert ia[1].state == ADMITTED and bg2.state == WAITING
    a.release(ia[0])
    assert bg2.state == WAITING  # still the last free slot
    a.release(ia[1])
    assert bg2.state == ADMITTED


def test_cancel_a_waiting_ticket():
    a = _adm(max_active=1, max_queued=1)
    first, second, third = Ticket(1, 1), Ticket(2, 1), Ticket(3, 1)
    a.submit(first)
    a.submit(second)
    assert a.cancel(second) is True and second.state == CANCELLED
    assert a.cancel(first) is False  # admitted: the engine cancels it
    a.submit(third)  # the cancelled one freed its queue slot
    a.release(first)
    assert third.state == ADMITTED and second.state == CANCELLED
    assert a.snapshot()["cancelled_waiting"] == 1


def test_drain_returns_everything_not_started():
    a = _adm(max_active=1, max_queued=3)
    ts = [Ticket(i, 1) for i in range(3)]
    for t in ts:
        a.submit(t)
    a.take()
    assert ts[0].state == TAKEN
    assert [t.item for t in a.drain()] == [1, 2]
    assert a.snapshot()["queued"] == 0


class AdmissionMachine(RuleBasedStateMachine):
    """Random submit / take / release / cancel: the limits always hold and each class
    is admitted in submission order."""

    def __init__(self) -> None:
        super().__init__()
        self.a = Admission(3, 4, 600, lambda n: n * 10, clock=Clock())
        self.tickets: list[Ticket] = []
        self.order: list[Ticket] = []  # admission order

    def _record(self) -> None:
        for t in self.tickets:
            if t.state in (ADMITTED, TAKEN) and t not in self.order:
                self.order.append(t)

    @rule(length=st.integers(1, 30), background=st.booleans())
    def submit(self, length: int, background: bool) -> None:
        t = Ticket(len(self.tickets), length, background=background)
        try:
            self.a.submit(t)
        except OverloadedError:
            assert t.state == CANCELLED
        self.tickets.append(t)
        self._record()

    @rule()
    def take(self) -> None:
        self.a.take()

    @precondition(lambda self: any(t.state in (ADMITTED, TAKEN) for t in self.tickets))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        live = [t for t in self.tickets if t.state in (ADMITTED, TAKEN)]
        self.a.release(data.draw(st.sampled_from(live)))
        self._record()

    @precondition(lambda self: any(t.state == WAITING for t in self.tickets))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        waiting = [t for t in self.tickets if t.state == WAITING]
        assert self.a.cancel(data.draw(st.sampled_from(waiting)))

    @invariant()
    def limits_hold(self) -> None:
        snap = self.a.snapshot()
        live = [t for t in self.tickets if t.state in (ADMITTED, TAKEN)]
        assert snap["active"] == len(live) <= 3
        assert snap["queued"] == sum(t.state == WAITING for t in self.tickets) <= 4
        assert snap["kv_reserved_bytes"] <= 600
        if live:
            assert snap["kv_reserved_bytes"] == len(live) * 10 * max(t.length for t in live)

    @invariant()
    def fifo_per_class(self) -> None:
        for background in (False, True):
            ids = [t.item for t in self.order if t.background == background]
            assert ids == sorted(ids)


TestAdmissionMachine = AdmissionMachine.TestCase
TestAdmissionMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
