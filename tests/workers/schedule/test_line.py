"""An owner's waiting line: interactive before batch, then tenants take turns, then
priority, then arrival."""

from __future__ import annotations

from workers.schedule.line import Line


def test_the_tenant_running_least_goes_first_whatever_arrived_before() -> None:
    line = Line()
    line.started("flood", 4)
    floods = [line.join("flood", 0, 1) for _ in range(5)]
    calm = line.join("calm", 0, 1)
    assert line.first() is calm
    line.leave(calm)
    line.started("calm", 1)
    assert line.first() is floods[0]  # 1 running against 4: still the calm one's turn next
    line.leave(floods[0])
    line.started("flood", 1)
    second = line.join("calm", 0, 1)
    assert line.first() is second
    assert line.waiting() == 5


def test_priority_orders_a_tenants_own_requests_but_buys_no_turn_over_another() -> None:
    line = Line()
    line.started("flood", 1)
    late = line.join("flood", -100, 1)
    calm = line.join("calm", 10, 1)
    assert line.first() is calm
    line.leave(calm)
    early = line.join("flood", 0, 1)
    assert line.first() is late
    line.leave(late)
    assert line.first() is early


def test_without_tenants_the_line_is_priority_then_arrival() -> None:
    line = Line()
    a, b, c = line.join("", 0, 2), line.join("", -1, 1), line.join("", 0, 1)
    assert line.first() is b
    line.leave(b)
    assert line.first() is a
    line.leave(a)
    assert line.first() is c and line.waiting() == 1


def test_sequences_count_each_choice_and_an_emptied_tenant_is_forgotten() -> None:
    line = Line()
    line.started("t", 8)
    line.stopped("t", 8)
    assert line.running == {}
    assert line.first() is None and line.waiting() == 0


def test_whose_turn_follows_every_start_and_stop() -> None:
    line = Line()
    line.started("a", 2)
    a, b = line.join("a", 0, 1), line.join("b", 0, 1)
    assert line.first() is b
    line.started("b", 3)
    assert line.first() is a
    line.stopped("b", 3)
    assert line.first() is b
    line.stopped("a", 2)  # both idle now: arrival decides
    assert line.first() is a


def test_a_batch_jobs_requests_wait_behind_every_interactive_one() -> None:
    line = Line()
    batch = [line.join("", -5, 1, batch=True) for _ in range(3)]  # first, and prioritised
    line.started("busy", 9)
    interactive = line.join("busy", 10, 1)  # its tenant runs the most, and it came last
    assert line.first() is interactive
    line.leave(interactive)
    assert line.first() is batch[0]
