"""The schedule simulator: schedules as data, and agreement with the closed form."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.cost import closed_form, simulate
from planner.plan.schedule import schedule_actions


def test_gpipe_and_1f1b_actions_are_the_textbook_order() -> None:
    assert schedule_actions("gpipe", 2, 3) == [
        ["F0", "F1", "F2", "B0", "B1", "B2"],
        ["F0", "F1", "F2", "B0", "B1", "B2"],
    ]
    assert schedule_actions("1f1b", 3, 4) == [
        ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"],
        ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"],
        ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"],
    ]
    with pytest.raises(ValueError, match="gpipe"):
        schedule_actions("zb", 2, 2)


def test_uniform_gpipe_has_the_textbook_bubble() -> None:
    p, m, f, b = 4, 8, 1.0, 2.0
    tl = simulate(fwd=[f] * p, bwd=[b] * p, micro_batches=m)
    assert tl.step_ms == pytest.approx((m + p - 1) * (f + b))
    assert tl.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


def test_gpipe_timeline_literal() -> None:
    tl = simulate(fwd=[1, 1], bwd=[2, 2], micro_batches=2, link_fwd=[0.5], link_bwd=[0.5])
    got = [(e.stage, e.kind, e.micro_batch, e.start, e.end) for e in tl.events]
    assert got == [
        (0, "F", 0, 0, 1),
        (0, "F", 1, 1, 2),
        (0, "send_F", 0, 1, 1.5),
        (1, "F", 0, 1.5, 2.5),
        (0, "send_F", 1, 2, 2.5),
        (1, "F", 1, 2.5, 3.5),
        (1, "B", 0, 3.5, 5.5),
        (1, "B", 1, 5.5, 7.5),
        (1, "send_B", 0, 5.5, 6),
        (0, "B", 0, 6, 8),
        (1, "send_B", 1, 7.5, 8),
        (0, "B", 1, 8, 10),
    ]
    assert tl.step_ms == 10


_times = st.lists(st.floats(0.1, 5.0), min_size=1, max_size=6)


@settings(max_examples=300, deadline=None)
@given(fwd=_times, m=st.integers(1, 12), data=st.data())
def test_gpipe_simulation_equals_the_closed_form(fwd, m, data) -> None:
    p = len(fwd)
    bwd = data.draw(st.lists(st.floats(0.1, 10.0), min_size=p, max_size=p))
    links = st.lists(st.floats(0.0, 2.0), min_size=p - 1, max_size=p - 1)
    lf, lb = data.draw(links), data.draw(links)
    kw = dict(fwd=fwd, bwd=bwd, micro_batches=m, link_fwd=lf, link_bwd=lb)
    assert simulate(**kw).step_ms == pytest.approx(closed_form(**kw), rel=1e-9)


@settings(max_examples=200, deadline=None)
@given(p=st.integers(1, 6), m=st.integers(1, 12), f=st.floats(0.1, 5), r=st.floats(1, 3))
def test_1f1b_equals_the_closed_form_on_uniform_stages(p, m, f, r) -> None:
    kw = dict(fwd=[f] * p, bwd=[f * r] * p, micro_batches=m, schedule="1f1b")
    assert simulate(**kw).step_ms == pytest.approx(closed_form(**kw), rel=1e-9)


@settings(max_examples=200, deadline=None)
@given(fwd=_times, m=st.integers(1, 12))
def test_1f1b_closed_form_bounds_uneven_stages_without_links(fwd, m) -> None:
    bwd = [2 * f for f in fwd]
    kw = dict(fwd=fwd, bwd=bwd, micro_batches=m, schedule="1f1b")
    assert simulate(**kw).step_ms <= closed_form(**kw) * (1 + 1e-9)


def test_every_tail_waits_for_every_stages_last_backward() -> None:
    # [Note: the step's agreement]: stage 1 finishes its backwards before stage 0, but
    # its tail (its optimizer step) waits for stage 0's last backward, as the runtime's
    # agreement on the loss and the gradient norm makes it.
    kw = dict(fwd=[1, 1], bwd=[2, 2], micro_batches=2)
    base = simulate(**kw).step_ms
    late = simulate(**kw, sync=[0.0, 1.5])
    assert late.step_ms == base + 1.5 == closed_form(**kw, sync=[0.0, 1.5])
    tail = next(e for e in late.events if e.kind == "tail" and e.stage == 1)
    assert tail.start == max(e.end for e in late.events if e.kind == "B")
    assert simulate(**kw, sync=[1.5, 0.0]).step_ms == base + 1.5


def test_one_stage_has_no_bubble() -> None:
    tl = simulate(fwd=[1.0], bwd=[2.0], micro_batches=4, sync=[5.0])
    assert tl.step_ms == 17.0
    assert tl.bubble_fraction == 0.0


def test_shared_cores_slow_the_stages_that_compute_at_once() -> None:
    # [Note: shared cores]: two stages computing together each run at half speed.
    tl = simulate(fwd=[1, 1], bwd=[1, 1], micro_batches=2, speed=[1.0, 0.5])
    got = [(e.stage, e.kind, e.micro_batch, e.start, e.end) for e in tl.events]
    assert got == [
        (0, "F", 0, 0, 1),  # alone
        (0, "F", 1, 1, 3),  # with stage 1's F0: half speed
        (1, "F", 0, 1, 3),
        (1, "F", 1, 3, 4),  # alone again
        (1, "B", 0, 4, 5),
        (0, "B", 0, 5, 7),  # with stage 1's B1
        (1, "B", 1, 5, 7),
        (0, "B", 1, 7, 8),
    ]
    assert tl.step_ms == 8
    full = simulate(fwd=[1, 1], bwd=[1, 1], micro_batches=2, speed=[1.0, 1.0])
    assert full.step_ms == simulate(fwd=[1, 1], bwd=[1, 1], micro_batches=2).step_ms == 6
    with pytest.raises(ValueError, match="speed"):
        simulate(fwd=[1, 1], bwd=[1, 1], micro_batches=2, speed=[1.0])


def test_the_fast_path_without_shared_cores_matches_the_event_driven_one() -> None:
    import random

    from planner.cost import simulate

    rng = random.Random(7)
    for _ in range(40):
        p, m = rng.randint(1, 5), rng.randint(1, 9)
        kw = dict(
            fwd=[rng.uniform(0.5, 3) for _ in range(p)],
            bwd=[rng.uniform(1, 6) for _ in range(p)],
            micro_batches=m,
            schedule=rng.choice(["gpipe", "1f1b"]),
            link_fwd=[rng.uniform(0, 1) for _ in range(p - 1)],
            link_bwd=[rng.uniform(0, 1) for _ in range(p - 1)],
            sync=[rng.uniform(0, 2) for _ in range(p)],
            reduce=[rng.uniform(0, 1) for _ in range(p)],
        )
        fast = simulate(**kw)  # every speed 1.0: list scheduling
        events = simulate(**kw, speed=[1.0 - 1e-12] * p)  # the event-driven loop
        assert fast.step_ms == pytest.approx(events.step_ms, rel=1e-9)
        assert len(fast.events) == len(events.events)
