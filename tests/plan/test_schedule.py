"""The schedules as data: each rank's order is the one torch runs, and it is complete."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

from planner.plan.schedule import (
    SCHEDULES,
    SIMULATED,
    held_at_peak,
    in_flight,
    rank_actions,
    schedule_problem,
    stage_ranks,
)

# (schedule, stages per rank) for every schedule the simulator prices
KINDS = [(s, 1) for s in SCHEDULES] + [
    ("interleaved-1f1b", 2),
    ("interleaved-1f1b", 3),
    ("looped-bfs", 2),
    ("interleaved-zb", 1),
    ("interleaved-zb", 2),
    ("zbv", 2),
    ("dualpipev", 2),
]


def _torch_loop(cls: type, p: int, m: int, s: int) -> list[str]:
    """What torch's single-stage schedule calls on stage ``s``: its forwards and
    backwards, recorded on a stand-in stage (no process group, no tensors)."""
    done: list[str] = []
    stage = SimpleNamespace(
        stage_index=s,
        num_stages=p,
        is_last=False,
        has_backward=True,
        get_fwd_recv_ops=lambda k: [],
        get_fwd_send_ops=lambda k: [],
        get_bwd_recv_ops=lambda k: [],
        get_bwd_send_ops=lambda k: [],
        forward_one_chunk=lambda k, *a, **kw: done.append(f"F{k}"),
        backward_one_chunk=lambda k, **kw: done.append(f"B{k}"),
        perform_reduce_grad=lambda *a: None,
    )
    schedule: Any = cls(stage, n_microbatches=m, loss_fn=lambda out, target: out)
    schedule._initialize_stage = lambda *a, **kw: None
    schedule._step_microbatches([()] * m, [{}] * m)
    return done


@pytest.mark.parametrize("name,cls", [("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)])
@pytest.mark.parametrize("p,m", [(1, 1), (2, 2), (2, 5), (3, 4), (4, 4), (4, 9)])
def test_gpipe_and_1f1b_are_the_order_torchs_own_loop_runs(name, cls, p, m) -> None:
    got = rank_actions(name, p, m)
    for s in range(p):
        assert [f"{a.kind}{a.micro_batch}" for a in got[s]] == _torch_loop(cls, p, m, s)
        assert {a.stage for a in got[s]} == {s}


@pytest.mark.parametrize("schedule,v", KINDS)
@pytest.mark.parametrize("p", [2, 3, 4])
def test_every_compute_runs_once_on_its_stages_rank(schedule, v, p) -> None:
    m = 2 * p * (2 if schedule == "dualpipev" else 1)
    on = stage_ranks(schedule, p, v)
    style = SIMULATED[schedule][1]
    assert on == tuple(
        generate_stage_to_rank_mapping(p, p * v, style=style)[s] for s in range(p * v)
    )
    acts = rank_actions(schedule, p, m, v)
    assert len(acts) == p
    seen: dict[tuple[int, int], list[str]] = {}
    for r, rank in enumerate(acts):
        for a in rank:
            assert on[a.stage] == r, f"{a} runs on rank {r}, its stage is on rank {on[a.stage]}"
            seen.setdefault((a.stage, a.micro_batch), []).append(a.kind)
    assert set(seen) == {(s, k) for s in range(p * v) for k in range(m)}
    for got in seen.values():  # a forward before the backward: whole, or input then weights
        assert got in (["F", "B"], ["F", "I", "W"]), got


def test_interleaved_1f1b_literal_order() -> None:
    """Two ranks, two stages each, four micro-batches: depth first, as torch runs it."""
    got = [" ".join(map(str, r)) for r in rank_actions("interleaved-1f1b", 2, 4, 2)]
    assert got == [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    ]


@pytest.mark.parametrize("p,m", [(1, 3), (2, 2), (3, 7), (4, 4), (5, 12)])
def test_in_flight_closed_forms_are_what_the_order_holds(p, m) -> None:
    for s in range(p):
        assert in_flight("1f1b", p, m, s) == held_at_peak("1f1b", p, m, s) == min(m, p - s)
        assert in_flight("gpipe", p, m, s) == held_at_peak("gpipe", p, m, s) == m


def test_in_flight_is_read_from_the_order() -> None:
    # Interleaved: the earlier stages hold more; the last, one at a time.
    assert [in_flight("interleaved-1f1b", 2, 4, s, 2) for s in range(4)] == [4, 3, 2, 1]


@pytest.mark.parametrize(
    "args,why",
    [
        (("gpipe", 2, 4, 2), "gpipe runs one stage per rank (v 2)"),
        (("zbv", 2, 4, 3), "zbv runs exactly two stages per rank (v 3)"),
        (("dualpipev", 4, 6, 2), "dualpipev needs micro-batches ≥ its 2·pp stages (m 6 < 8)"),
        (("interleaved-1f1b", 4, 9, 2), "interleaved-1f1b needs m a multiple of its rounds"),
        (("nope", 2, 2), "unknown schedule 'nope'"),
    ],
)
def test_schedule_problems_say_why_and_how_to_fix(args, why) -> None:
    problem = schedule_problem(*args)
    assert problem is not None and problem[0].startswith(why) and problem[1]
    with pytest.raises(ValueError, match="fix: "):
        rank_actions(*args)


def test_1f1b_with_fewer_micro_batches_than_stages_is_refused_yet_priced() -> None:
    why, fix = schedule_problem("1f1b", 4, 2)  # type: ignore[misc]
    assert why == "1f1b needs micro-batches ≥ stages (m 2 < pp 4)"
    assert fix == "--schedule gpipe, or --micro-batches 4 or more"
    assert [len(r) for r in rank_actions("1f1b", 4, 2)] == [4] * 4  # the simulator prices it
