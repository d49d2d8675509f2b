"""The cost model with several stages per pipeline rank: the step simulates torch's order of
the multi-stage schedule, and a device's memory is the sum of its stages'."""

from __future__ import annotations

import pytest
from models import chain_profiles

from planner.cost import CostModel, Layout, simulate
from planner.devices.build import from_gpus
from planner.options import Training

BLOCKS = 12


def _model(schedule: str, ranks: tuple[int, ...], m: int = 4, pp: int = 2) -> CostModel:
    v = len(ranks) // pp
    layout = Layout(
        pp=pp,
        dp=1,
        micro_batches=m,
        schedule=schedule,
        ranks=tuple((r,) for r in ranks),
        virtual=v,
    )
    prof = chain_profiles(BLOCKS, heavy_ends=False)("h100", 2)
    return CostModel({"h100": prof}, from_gpus(pp, "h100"), Training(global_batch=2 * m), layout)


def test_an_interleaved_step_is_the_simulation_of_torchs_order() -> None:
    cm = _model("interleaved-1f1b", (0, 1, 0, 1))
    pred = cm.predict((0, 3, 6, 9))
    inp = pred.inputs
    assert inp.virtual == 2 and len(inp.fwd_ms) == 4 and len(inp.speed) == 2
    again = simulate(
        fwd=inp.fwd_ms,
        bwd=inp.bwd_ms,
        micro_batches=4,
        schedule="interleaved-1f1b",
        link_fwd=inp.link_fwd_ms,
        link_bwd=inp.link_bwd_ms,
        sync=inp.tail_ms,
        reduce=inp.reduce_ms,
        virtual=2,
    )
    assert pred.step_ms == pytest.approx(again.step_ms)
    assert pred.timeline.n_ranks == 2
    assert pred.closed_form_ms == pred.step_ms  # no closed form: the simulation's
    assert cm.step_ms((0, 3, 6, 9)) == pred.step_ms
    # Two stages per rank on 2 devices beat one stage per device on the same blocks.
    one = _model("1f1b", (0, 1)).predict((0, 6))
    assert pred.step_ms < one.step_ms


def test_a_device_holds_the_sum_of_its_stages() -> None:
    pred = _model("interleaved-1f1b", (0, 1, 0, 1)).predict((0, 3, 6, 9))
    assert pred.stage_ranks == (0, 1, 0, 1)
    totals = [st.memory.total for st in pred.stages]
    assert pred.rank_memory == pytest.approx((totals[0] + totals[2], totals[1] + totals[3]))
    assert pred.fits
    # Interleaved: the first stage holds the most micro-batches in flight (4), the last one.
    acts = [st.memory.activations for st in pred.stages]
    assert acts[0] > acts[3]


def test_zb_v_keeps_the_turn_on_one_device() -> None:
    pred = _model("zbv", (0, 1, 1, 0)).predict((0, 3, 6, 9))
    kinds = {e.kind for e in pred.timeline.events}
    assert {"I", "W"} <= kinds and "B" not in kinds
    sends = {(e.kind, e.stage) for e in pred.timeline.events if e.kind.startswith("send")}
    assert ("send_F", 1) not in sends  # stages 1 and 2 share pipeline rank 1


def test_stages_of_one_pipeline_rank_need_the_same_devices() -> None:
    with pytest.raises(ValueError, match="stage 2 runs on pipeline rank 0, as stage 0"):
        _model("interleaved-1f1b", (0, 1, 1, 0))
    with pytest.raises(ValueError, match="one stage per rank"):
        _model("1f1b", (0, 1, 0, 1))
