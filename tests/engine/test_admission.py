"""Admission control (pure Python): limits, the bounded queue, KV bytes, priorities."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from promptcache.engine.requests.admission import (
    ADMITTED,
    CANCELLED,
    TAKEN,
    WAITING,
    Admission,
    Ticket,
)
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


def test_retry_after_follows_the_measured_queue():
    """Before any request finished: the age of the oldest active one; then at least
    what queued requests recently waited; bounded by MAX_RETRY_AFTER_S."""
    from promptcache.engine.requests.admission import MAX_RETRY_AFTER_S

    clock = Clock()
    a = _adm(max_active=1, max_queued=1, clock=clock)
    t = [Ticket(i, 10) for i in range(4)]
    a.submit(t[0])
    a.submit(t[1])  # waits
    clock.t += 37.0  # the active request has run 37 s, none has finished
    with pytest.raises(OverloadedError) as e:
        a.submit(t[2])
    assert e.value.retry_after_s == 74  # 37 s x (1 waiting + 1) / 1 slot
    clock.t += 200.0
    a.take()
    a.release(t[0])  # t[1] waited 237 s; t[0] served in 237 s
    assert a.stats.recent_wait_s == pytest.approx(237.0)
    assert a.retry_after_s() == 237
    clock.t += 1000.0
    a.take()
    a.release(t[1])  # service EWMA 0.8 x 237 + 0.2 x 1000 = 389.6
    a.submit(t[3])
    assert a.retry_after_s() == 390
    a.stats.recent_service_s = 10_000.0
    assert a.retry_after_s() == MAX_RETRY_AFTER_S == 600


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


def test_background_never_takes_an_interactive_queue_position():
    """Background tickets wait in a queue of their own: interactive requests are queued
    and refused exactly as without them, and the two are counted apart."""
    a = _adm(max_active=2, max_queued=1)
    ia = [Ticket(f"ia{i}", 1) for i in range(4)]
    bg = [Ticket(f"bg{i}", 1, background=True) for i in range(2)]
    a.submit(ia[0])
    a.submit(bg[0])  # the last free slot is for an interactive request: waits
    with pytest.raises(OverloadedError):
        a.submit(bg[1])  # over the background queue's own bound
    a.submit(ia[1])  # the free slot, past the waiting background ticket
    a.submit(ia[2])  # queued: the waiting background ticket holds no queue position
    with pytest.raises(OverloadedError) as e:
        a.submit(ia[3])
    assert "1 waiting" in str(e.value)
    assert [t.state for t in ia] == [ADMITTED, ADMITTED, WAITING, CANCELLED]
    assert (bg[0].state, bg[1].state) == (WAITING, CANCELLED)
    snap = a.snapshot()
    assert {k: snap[k] for k in ("active", "queued", "admitted", "queued_total", "rejected",
                                 "background_active", "background_queued",
                                 "background_admitted", "background_rejected")} == {
        "active": 2, "queued": 1, "admitted": 2, "queued_total": 1, "rejected": 1,
        "background_active": 0, "background_queued": 1, "background_admitted": 0,
        "background_rejected": 1}
    a.release(ia[0])
    assert ia[2].state == ADMITTED and bg[0].state == WAITING  # interactive first
    a.release(ia[1])
    a.release(ia[2])
    assert bg[0].state == ADMITTED  # idle: the background ticket runs
    snap = a.snapshot()
    assert (snap["admitted"], snap["background_admitted"], snap["background_active"]) == (3, 1, 1)


def test_a_waiting_interactive_ticket_preempts_background_ones():
    """An interactive ticket that finds every slot taken, some by background tickets,
    gets the newest background slot: on_preempt is told, and the release admits it."""
    told: list[Ticket] = []
    clock = Clock()
    a = Admission(3, 2, None, lambda n: n * 10, clock=clock, on_preempt=told.append)
    i0 = Ticket("i0", 1)
    b0, b1 = Ticket("b0", 1, background=True), Ticket("b1", 1, background=True)
    a.submit(b0)
    clock.t += 1.0
    a.submit(b1)  # 2 of 3 slots: not the last one
    a.submit(i0)  # the last slot
    assert told == [] and [t.state for t in (b0, b1, i0)] == [ADMITTED] * 3
    i1 = Ticket("i1", 1)
    a.submit(i1)
    assert i1.state == WAITING and told == [b1] and b1.preempted and not b0.preempted
    i2 = Ticket("i2", 1)
    a.submit(i2)  # i1 still waits for b1's slot: nothing more is preempted for it yet
    assert told == [b1]
    a.release(b1)  # the engine dropped it
    assert i1.state == ADMITTED and told == [b1, b0]  # now i2 waits: b0 goes too
    a.release(b0)
    assert i2.state == ADMITTED
    assert a.snapshot()["background_preempted"] == 2


def test_preemption_for_the_kv_budget():
    told: list[Ticket] = []
    a = Admission(8, 2, 1000, lambda n: n * 10, clock=Clock(), on_preempt=told.append)
    bg, small = Ticket("bg", 40, background=True), Ticket("small", 10)
    a.submit(bg)  # 400
    a.submit(small)  # 2 x 400
    big = Ticket("big", 50)  # 3 x 500 > 1000, but 2 x 500 fits without the background one
    a.submit(big)
    assert big.state == WAITING and told == [bg]
    a.release(bg)
    assert big.state == ADMITTED
    a.release(small)
    a.release(big)
    told.clear()
    a.submit(Ticket("held", 10))
    a.submit(Ticket("bg2", 10, background=True))
    huge = Ticket("huge", 60)  # 2 x 600 > 1000 even without the background ticket
    a.submit(huge)
    assert huge.state == WAITING and told == []  # preempting would not let it in


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
        self.told: list[Ticket] = []  # on_preempt calls
        self.a = Admission(3, 4, 600, lambda n: n * 10, clock=Clock(),
                           on_preempt=self.told.append)
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
        self._record()

    @invariant()
    def limits_hold(self) -> None:
        snap = self.a.snapshot()
        live = [t for t in self.tickets if t.state in (ADMITTED, TAKEN)]
        assert len(live) <= 3
        assert snap["active"] == sum(not t.background for t in live)
        assert snap["background_active"] == sum(t.background for t in live)
        waiting = [t for t in self.tickets if t.state == WAITING]
        # tickets that only wait for preempted background ones hold no queue position
        room = 3 if any(t.preempted for t in live) else 0
        assert snap["queued"] == sum(not t.background for t in waiting) <= 4 + room
        assert snap["background_queued"] == sum(t.background for t in waiting) <= 4
        assert snap["kv_reserved_bytes"] <= 600
        if live:
            assert snap["kv_reserved_bytes"] == len(live) * 10 * max(t.length for t in live)

    @staticmethod
    def _fits(t: Ticket, others: list[Ticket]) -> bool:
        lengths = [o.length for o in others] + [t.length]
        return len(others) < 3 and len(lengths) * 10 * max(lengths) <= 600

    @invariant()
    def background_gives_way(self) -> None:
        """Preempted only background tickets, each told once; a waiting interactive
        ticket that would fit without the admitted background ones has had enough of
        them preempted to fit once they are released."""
        assert len(self.told) == len(set(map(id, self.told)))
        assert all(t.background and t.preempted for t in self.told)
        assert self.a.stats.background_preempted == len(self.told)
        head = next((t for t in self.tickets if t.state == WAITING and not t.background), None)
        if head is None:
            return
        live = [t for t in self.tickets if t.state in (ADMITTED, TAKEN)]
        interactive = [t for t in live if not t.background]
        if self._fits(head, interactive):
            kept = [t for t in live if not t.preempted]
            assert self._fits(head, kept)

    @invariant()
    def fifo_per_class(self) -> None:
        for background in (False, True):
            ids = [t.item for t in self.order if t.background == background]
            assert ids == sorted(ids)


TestAdmissionMachine = AdmissionMachine.TestCase
TestAdmissionMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
