"""[Note: the step's agreement]: before any optimizer steps, every rank reads its
gradients for the global norm, and no stage's tail starts before every stage's last
backward has ended (the runtime agrees on the loss and the norm over the pipeline)."""

from __future__ import annotations

import pytest
from models import block_cost, cpu_cluster, model_profile, usable_cores

from planner.cost import CostModel, Layout
from planner.cost.agreement import AGREE_FIXED_MS, NORM_OPS, NORM_PASSES
from planner.options import Training
from planner.plan.records import ModelProfile

MB = 2**20


def _profile() -> ModelProfile:
    """Four blocks; block 0 holds no parameter, the others 4 MiB each (one module call)."""
    blocks = [block_cost(k, param_bytes=4 * MB if k else 0) for k in range(4)]
    return model_profile(blocks, input_bytes=MB, loss_fwd_ms=0.5, loss_bwd_ms=0.25)


def _cpu(pp: int, dp: int = 1, cores: int = 8) -> CostModel:
    ranks = tuple(tuple(r * pp + s for r in range(dp)) for s in range(pp))
    layout = Layout(pp=pp, dp=dp, micro_batches=2, schedule="gpipe", ranks=ranks)
    with usable_cores(cores):
        cluster = cpu_cluster(pp * dp)
        return CostModel({"cpu": _profile()}, cluster, Training(global_batch=8 * dp), layout)


def test_on_cpu_the_norm_reads_the_gradients_a_tensor_at_a_time() -> None:
    cm = _cpu(pp=1)
    # 3 blocks × 4 MiB of fp32 gradients, 2 tensors each (one module call), at the test
    # CPU's 20 GB/s and 1 µs a dispatch; one process on its own cores: not slowed.
    want = AGREE_FIXED_MS["gloo"] + (6 * NORM_OPS * 1e-6 + NORM_PASSES * 12 * MB / 20e9) * 1e3
    assert cm.time.agree_ms(0, 0, 4) == pytest.approx(want)
    assert cm.time.agree_ms(0, 0, 1) == AGREE_FIXED_MS["gloo"]  # the checks: no gradient
    assert cm.time.sync(0, 0, 4) == pytest.approx(want + cm.time.optimizer_ms(0, 0, 4))
    # Four processes on two cores: CPU work, time-sliced like the compute.
    slow = _cpu(pp=2, dp=2, cores=2)
    alone = AGREE_FIXED_MS["gloo"] + (4 * NORM_OPS * 1e-6 + NORM_PASSES * 8 * MB / 20e9) * 1e3
    assert slow.time.agree_ms(1, 2, 4) == pytest.approx(alone * slow.time.compute_scale)


def test_no_optimizer_steps_before_every_stage_has_ended_its_backward() -> None:
    # Stage 1 (3 blocks) ends its backwards first, stage 0 (block 0) last: stage 1's
    # tail starts when stage 0's last backward ends, not at its own.
    tl = _cpu(pp=2).predict((0, 1)).timeline
    tails = sorted((e for e in tl.events if e.kind == "tail"), key=lambda e: e.stage)
    last_b = max(e.end for e in tl.events if e.kind == "B")
    own_b = max(e.end for e in tl.events if e.kind == "B" and e.stage == 1)
    assert own_b < last_b
    assert [t.start for t in tails] == [pytest.approx(last_b)] * 2
    assert tl.step_ms == pytest.approx(tails[1].end)
