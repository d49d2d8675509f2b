"""The simulator on torch's multi-stage schedules: the textbook bubbles, a split backward's
parts, stages sharing a rank."""

from __future__ import annotations

import pytest

from planner.cost import simulate
from planner.cost.step_graph import step_graph

F, B = 1.0, 2.0  # a whole rank's forward and backward per micro-batch (I = W = F)


def _uniform(schedule: str, p: int, m: int, v: int, **kw) -> float:
    n = p * v
    return simulate(
        fwd=[F / v] * n, bwd=[B / v] * n, micro_batches=m, schedule=schedule, virtual=v, **kw
    ).step_ms


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 12), (8, 24)])
@pytest.mark.parametrize("v", [2, 4])
def test_interleaving_divides_the_1f1b_bubble_by_v(p, m, v) -> None:
    """Megatron's interleaved schedule: bubble (p − 1)·(f + b) / v (m a multiple of p)."""
    assert _uniform("1f1b", p, m, 1) == pytest.approx((m + p - 1) * (F + B))
    assert _uniform("interleaved-1f1b", p, m, v) == pytest.approx((m + (p - 1) / v) * (F + B))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 24)])
def test_zero_bubble_1p_has_a_third_of_the_1f1b_bubble(p, m) -> None:
    """The zero-bubble paper's ZB-H1: bubble (p − 1)(T_F + T_B − T_W), with T_B the input
    part; a third of 1F1B's (p − 1)(T_F + T_B + T_W) when the three are equal."""
    one = _uniform("1f1b", p, m, 1) - m * (F + B)
    zb = _uniform("interleaved-zb", p, m, 1) - m * (F + B)
    assert one == pytest.approx((p - 1) * 3 * F)
    assert zb == pytest.approx((p - 1) * F)


def test_the_papers_ordering_on_its_8_stage_setting() -> None:
    """p = 8, m = 24 on equal stages: 1F1B > Interleaved 1F1B > ZB-1p > ZB-V."""
    steps = {
        name: _uniform(name, 8, 24, v)
        for name, v in [("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-zb", 1), ("zbv", 2)]
    }
    assert steps["1f1b"] > steps["interleaved-1f1b"] > steps["interleaved-zb"] > steps["zbv"]
    assert steps["zbv"] >= 24 * (F + B)


def test_a_split_backward_computes_its_weight_share_apart() -> None:
    tl = simulate(
        fwd=[1, 1], bwd=[4, 4], micro_batches=2, schedule="interleaved-zb", weight_share=[0.25, 0.5]
    )
    dur = {(e.stage, e.kind, e.micro_batch): e.end - e.start for e in tl.events}
    assert dur[(0, "I", 0)] == pytest.approx(3.0) and dur[(0, "W", 0)] == pytest.approx(1.0)
    assert dur[(1, "I", 1)] == pytest.approx(2.0) and dur[(1, "W", 1)] == pytest.approx(2.0)
    whole = simulate(fwd=[1, 1], bwd=[4, 4], micro_batches=2, schedule="1f1b")
    assert tl.step_ms < whole.step_ms  # the weights' part fills the bubble


def test_stages_on_one_rank_send_nothing_between_them() -> None:
    """ZB-V's turn (stages p − 1 and p on the last rank) is local; the other links carry."""
    g = step_graph("zbv", 4, 2, 2)
    assert g.ranks == (0, 1, 1, 0)
    sent = {(n.kind, n.stage) for n in g.nodes if n.kind.startswith("send")}
    assert ("send_F", 1) not in sent and ("send_B", 2) not in sent
    assert {("send_F", 0), ("send_F", 2), ("send_B", 1), ("send_B", 3)} <= sent
    with_links = simulate(
        fwd=[1] * 4, bwd=[2] * 4, micro_batches=2, schedule="zbv", virtual=2,
        link_fwd=[0.0, 5.0, 0.0], link_bwd=[0.0, 5.0, 0.0],
    )  # fmt: skip
    alone = simulate(fwd=[1] * 4, bwd=[2] * 4, micro_batches=2, schedule="zbv", virtual=2)
    assert with_links.step_ms == alone.step_ms  # link 1 → 2 is never used


def test_speed_and_bubble_count_ranks_not_stages() -> None:
    with pytest.raises(ValueError, match="one entry per rank"):
        simulate(fwd=[1] * 4, bwd=[2] * 4, micro_batches=4, schedule="interleaved-1f1b",
                 virtual=2, speed=[1.0] * 4)  # fmt: skip
    tl = simulate(fwd=[1] * 4, bwd=[2] * 4, micro_batches=4, schedule="interleaved-1f1b",
                  virtual=2, speed=[1.0, 0.5])  # fmt: skip
    assert tl.n_ranks == 2
    fast = simulate(fwd=[1] * 4, bwd=[2] * 4, micro_batches=4, schedule="interleaved-1f1b",
                    virtual=2).step_ms  # fmt: skip
    assert fast < tl.step_ms <= 2 * fast + 1e-9  # half speed while both ranks compute
    busy = sum(tl.busy_ms(s) for s in range(4))
    assert tl.bubble_fraction == pytest.approx(1 - busy / (2 * tl.compute_ms))
