"""The step graph, and the lower bounds drawn from its paths: never above the simulated step."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.cost import simulate, work_bound
from planner.cost.segment_bound import SegmentBound
from planner.cost.step_graph import step_graph


def test_the_graph_of_a_small_gpipe_step() -> None:
    g = step_graph("gpipe", 2, 2)
    names = [f"{n.kind}{n.micro_batch}@{n.stage}" for n in g.nodes]
    assert names == [
        "F0@0",
        "send_F0@0",
        "F1@0",
        "send_F1@0",
        "F0@1",
        "F1@1",
        "B0@1",
        "send_B0@1",
        "B0@0",
        "B1@1",
        "send_B1@1",
        "B1@0",
        "tail-1@0",
        "tail-1@1",
    ]
    by_name = dict(zip(names, range(len(names)), strict=True))
    assert g.nodes[by_name["send_F1@0"]].preds == (by_name["F1@0"], by_name["send_F0@0"])
    assert g.nodes[by_name["B1@0"]].fixed == (("reduce", 0),)  # the last backward all-reduces
    assert g.nodes[by_name["B0@0"]].fixed == ()
    assert [g.nodes[t].kind for t in g.tails] == ["tail", "tail"]
    for v, node in enumerate(g.nodes):
        assert all(u < v for u in node.preds)
        assert len(set(node.preds)) == len(node.preds)


def _stages(rng: random.Random, p: int) -> dict[str, list[float]]:
    return {
        "fwd": [rng.uniform(0.1, 5) for _ in range(p)],
        "bwd": [rng.uniform(0.1, 9) for _ in range(p)],
        "link_fwd": [rng.choice([0.0, rng.uniform(0, 2)]) for _ in range(p - 1)],
        "link_bwd": [rng.choice([0.0, rng.uniform(0, 2)]) for _ in range(p - 1)],
        "sync": [rng.uniform(0, 3) for _ in range(p)],
        "reduce": [rng.uniform(0, 1) for _ in range(p)],
    }


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 10**6), p=st.integers(1, 6), schedule=st.sampled_from(["gpipe", "1f1b"]))
def test_the_work_bound_never_exceeds_the_simulated_step(seed: int, p: int, schedule: str) -> None:
    rng = random.Random(seed)
    m = rng.randint(p, 2 * p) if schedule == "1f1b" else rng.randint(1, 8)
    kw = _stages(rng, p)
    speed = sorted((rng.uniform(0.2, 1.0) for _ in range(p)), reverse=True)
    if rng.random() < 0.5:
        speed = [1.0] * p
    work = [f + b for f, b in zip(kw["fwd"], kw["bwd"], strict=True)]
    step = simulate(**kw, micro_batches=m, schedule=schedule, speed=speed).step_ms  # type: ignore[arg-type]
    assert work_bound(sum(work), max(work), p, m, schedule) <= step * (1 + 1e-9)


def test_1f1b_can_beat_the_gpipe_bound() -> None:
    # Why 1F1B has a bound of its own (see work_bound).
    step = simulate(fwd=[10, 1], bwd=[10, 1], micro_batches=2, schedule="1f1b").step_ms
    assert step == 40 < work_bound(22, 20, 2, 2, "gpipe")
    assert work_bound(22, 20, 2, 2, "1f1b") <= step


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_segment_bounds_hold_for_every_placement_through_the_segment(schedule: str) -> None:
    rng = random.Random(5 if schedule == "gpipe" else 6)
    for _ in range(25):
        n, S = rng.randint(3, 7), rng.randint(2, 3)
        m = rng.randint(S, 2 * S) if schedule == "1f1b" else rng.randint(1, 4)
        _check_segment_bounds(rng, n, S, m, schedule)


def _check_segment_bounds(rng: random.Random, n: int, S: int, m: int, schedule: str) -> None:
    f = [rng.uniform(0.1, 3) for _ in range(n)]
    b = [rng.uniform(0.1, 5) for _ in range(n)]
    red = [rng.uniform(0, 1) for _ in range(n)]
    tail = [rng.uniform(0, 2) for _ in range(n)]
    cut = [(rng.uniform(0, 1), rng.uniform(0, 1)) for _ in range(n + 1)]

    def figures(s: int, i: int, j: int) -> tuple[float, float, float, float]:
        return sum(f[i:j]), sum(b[i:j]), sum(red[i:j]), max(tail[i:j])

    bound = SegmentBound(
        n_stages=S,
        micro_batches=m,
        schedule=schedule,
        positions=list(range(n + 1)),
        figures=figures,
        cuts=lambda s, j: cut[j],
    )
    for cuts in itertools.combinations(range(1, n), S - 1):
        bounds = [0, *cuts, n]
        segs = [figures(s, bounds[s], bounds[s + 1]) for s in range(S)]
        step = simulate(
            fwd=[x[0] for x in segs],
            bwd=[x[1] for x in segs],
            reduce=[x[2] for x in segs],
            sync=[x[3] for x in segs],
            link_fwd=[cut[j][0] for j in cuts],
            link_bwd=[cut[j][1] for j in cuts],
            micro_batches=m,
            schedule=schedule,
        ).step_ms
        for s in range(S):
            assert bound(s, bounds[s], bounds[s + 1]) <= step * (1 + 1e-9), (s, bounds)
