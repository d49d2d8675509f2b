"""FSDP (``dp_mode: fsdp``): how a stage sharded over its replicas is priced, and searched.

The runtime makes each stage one unit of torch's ``fully_shard`` ([Note: FSDP as
it runs] in planner.cost.basis): a shard of every weight, gradient and state
between steps, the weights gathered whole from the first forward to the last
backward, one reduce-scatter after it. The figures below are worked out by hand
from that, on stages without activations (so the weights, gradients and state
alone make the peak), and checked against the cost model.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from models import chain_profiles, cpu_cluster

from planner.cost.basis import Layout
from planner.cost.model import CostModel
from planner.devices import from_gpus
from planner.options import SearchOptions, Training
from planner.plan.records import ModelProfile, TiedSet
from planner.search import search

MIB, GIB = 2**20, 2**30
N = 8 * 256 * MIB / 4  # parameters of the 8 blocks of 256 MiB (fp32) at pp 1


def _profile(*, bare: bool, tied: int = 0) -> ModelProfile:
    """8 blocks of 256 MiB fp32 parameters at micro-batch 1; ``bare``: no activations, no
    outputs, no boundaries (nothing but weights, gradients and state to hold); ``tied``:
    bytes of one tensor blocks 0 and 7 share."""
    prof = chain_profiles(n_blocks=8, param_bytes=256 * MIB)("h100", 1)
    if bare:
        blocks = tuple(
            replace(x, activation_bytes=0, output_bytes=0, boundary_bytes=0) for x in prof.blocks
        )
        prof = replace(prof, blocks=blocks)
    if tied:
        prof = replace(prof, tied=(TiedSet(names=("a.w", "b.w"), blocks=(0, 7), nbytes=tied),))
    return prof


def _cost(
    dp_mode: str,
    *,
    dp: int = 4,
    pp: int = 1,
    m: int = 1,
    optimizer: str = "adam",
    precision: str = "fp32",
    bare: bool = True,
    tied: int = 0,
) -> CostModel:
    layout = Layout(
        pp=pp, dp=dp, micro_batches=m, schedule="1f1b",
        ranks=tuple(tuple(r * pp + s for r in range(dp)) for s in range(pp)), dp_mode=dp_mode,
    )  # fmt: skip
    training = Training(global_batch=dp * m, optimizer=optimizer, precision=precision)
    prof = _profile(bare=bare, tied=tied)
    return CostModel({"h100": prof}, from_gpus(pp * dp, "h100"), training, layout)


def test_fsdp_memory_by_hand() -> None:
    # dp 4, fp32, Adam (8 bytes of state a parameter): the peak is the reduce-scatter's
    # moment, the weights whole and their shard (4 · (1 + 1/4) = 5 bytes a parameter), the
    # gradients whole and the scatter's output (5), a quarter of the state (2): 12 bytes.
    fsdp = _cost("fsdp").memory(0, 0, 8)
    assert fsdp.params == pytest.approx(5 * N)
    assert fsdp.grads == pytest.approx(5 * N)
    assert fsdp.optimizer == pytest.approx(2 * N)
    assert fsdp.comm_buffers == 0 and fsdp.activations == 0
    assert fsdp.total == pytest.approx(12 * N)
    # DDP: weights 4, gradients 4, its buckets 4, Adam's moments 8: 20 bytes a parameter.
    ddp = _cost("ddp").memory(0, 0, 8)
    assert ddp.comm_buffers == pytest.approx(4 * N) and ddp.total == pytest.approx(20 * N)
    # SGD with momentum (4 bytes of state): FSDP 5 + 5 + 1 = 11, DDP 4 + 4 + 4 + 4 = 16.
    assert _cost("fsdp", optimizer="sgd").memory(0, 0, 8).total == pytest.approx(11 * N)
    assert _cost("ddp", optimizer="sgd").memory(0, 0, 8).total == pytest.approx(16 * N)
    # dp 2, Adam: FSDP 6 + 6 + 4 = 16 against DDP's 20. FSDP is below DDP whatever the
    # optimizer: the extra (weights + gradients) / dp it holds at its peak is at most
    # DDP's buckets (a gradient's 4 bytes) for any dp ≥ 2, and its state is smaller.
    assert _cost("fsdp", dp=2).memory(0, 0, 8).total == pytest.approx(16 * N)


def test_fsdp_bf16_mixed_holds_the_accumulated_gradients_in_bf16() -> None:
    # bf16-mixed, m 2: a later backward holds the bf16 cast of the gathered weights (2
    # bytes) beside them (5), and its fresh fp32 gradients (4) beside those accumulated
    # in bf16 (2): 7 + 6 + 2 (Adam's quarter) = 15 bytes a parameter, over the
    # reduce-scatter's 7 + 5 + 2 = 14.
    mem = _cost("fsdp", m=2, precision="bf16-mixed").memory(0, 0, 8)
    assert mem.params == pytest.approx(7 * N) and mem.grads == pytest.approx(6 * N)
    assert mem.total == pytest.approx(15 * N)
    # fp32, m 2: one gradient tensor (a block's 256 MiB) is added to those held.
    mem = _cost("fsdp", m=2).memory(0, 0, 8)
    assert mem.total == pytest.approx(12 * N)  # the reduce-scatter's: 256 MiB < N · 4 / 4


def test_fsdp_prices_a_tied_copy_as_a_parameter_of_its_stage() -> None:
    # pp 2: stage 1 (blocks 4-7) holds a copy of the 64 MiB tensor block 0 owns: priced
    # as its own 4 blocks' parameters are, 12 bytes a parameter at dp 4 (Adam), and
    # gathered and scattered with them.
    cost = _cost("fsdp", pp=2, tied=64 * MIB)
    n, t = N / 2, 64 * MIB / 4
    mem = cost.memory(1, 4, 8)
    assert mem.tied_copies == pytest.approx(12 * t)
    assert mem.total == pytest.approx(12 * (n + t))
    gather, scatter = cost.time.fsdp_ms(1, 4, 8)
    ring = cost.cluster.allreduce_time(cost.layout.ranks[1], (n + t) * 4)
    assert gather == pytest.approx(ring / 2 * 1e3) and scatter == pytest.approx(gather)


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_fsdp_time_is_half_an_all_reduce_each_way_and_a_quarter_step(precision: str) -> None:
    fsdp, ddp = _cost("fsdp", precision=precision), _cost("ddp", precision=precision)
    gather, scatter = fsdp.time.fsdp_ms(0, 0, 8)
    ring = fsdp.cluster.allreduce_time(fsdp.layout.ranks[0], N * 4)  # the fp32 weights
    assert gather == pytest.approx(ring / 2 * 1e3)
    # The gradients as DDP's all-reduce sends them (bf16 under bf16-mixed), half its time.
    assert scatter == pytest.approx(ddp.time.reduce_ms(0, 0, 8) / 2)
    assert fsdp.time.reduce_ms(0, 0, 8) == 0 and ddp.time.fsdp_ms(0, 0, 8) == (0, 0)
    # The optimizer steps a quarter of the parameters: a quarter of the GPU's pass.
    step = fsdp.time.optimizer_ms(0, 0, 8)
    assert step == pytest.approx(ddp.time.optimizer_ms(0, 0, 8) / 4)
    # The norm before it reads a replica's shard of the gradients: a quarter too.
    norm = fsdp.time.agree_ms(0, 0, 8)
    assert norm == pytest.approx(ddp.time.agree_ms(0, 0, 8) / 4)
    assert fsdp.time.sync(0, 0, 8) == pytest.approx(step + gather + scatter + norm)
    # Both collectives in the stage's tail, none inside its last backward.
    inputs = fsdp.predict((0,)).inputs
    assert inputs.reduce_ms == (0.0,)
    assert inputs.tail_ms[0] == pytest.approx(step + gather + scatter + norm)


def test_fsdp_on_gloo_is_priced_at_gloos_measured_multiples_of_its_all_reduce() -> None:
    # [Note: gloo's all-gather and reduce-scatter]: not half an all-reduce each, as rings.
    layout = Layout(pp=1, dp=2, micro_batches=1, schedule="1f1b", ranks=((0, 1),),
                    dp_mode="fsdp")  # fmt: skip
    prof = replace(_profile(bare=True), device="cpu")
    cost = CostModel({"cpu": prof}, cpu_cluster(2), Training(global_batch=2), layout)
    gather, scatter = cost.time.fsdp_ms(0, 0, 8)
    ring = cost.cluster.allreduce_time((0, 1), N * 4) * 1e3 * cost.time.comm_scale
    wait = cost.time.wakeup_s * 1e3  # not time-sliced
    assert gather == pytest.approx(1.3 * ring + wait)
    assert scatter == pytest.approx(1.8 * ring + wait)


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_the_pruning_floor_stays_below_every_fsdp_peak(precision: str) -> None:
    cost = _cost("fsdp", pp=2, m=4, precision=precision, bare=False, tied=64 * MIB)
    for s in range(2):
        for i in range(8):
            for j in range(i + 1, 9):
                floor = cost.memory_floor(s, i, j)
                assert floor <= cost.memory(s, i, j, True).total
                assert floor <= cost.memory(s, i, j, False).total


def test_fsdp_needs_replicas() -> None:
    with pytest.raises(ValueError, match=r"dp mode fsdp .* needs dp ≥ 2"):
        _cost("fsdp", dp=1)
    with pytest.raises(ValueError, match="--dp-mode fsdp needs dp ≥ 2"):
        _search(SearchOptions(dp=1, dp_mode="fsdp"))


def _search(options: SearchOptions):  # type: ignore[no-untyped-def]
    # 4 blocks of 1.125 Gi fp32 parameters (4.5 Gi in all) on 8 H100 (71.6 GiB usable): at
    # pp 1 × dp 8, DDP holds 20 bytes a parameter (90 GiB); FSDP at its reduce-scatter the
    # weights whole and a shard (4.5), the gradients and the scatter's output (4.5), an
    # eighth of Adam's moments (1): 10 bytes, 45 GiB.
    chain = chain_profiles(n_blocks=4, param_bytes=int(4.5 * GIB), heavy_ends=False)
    return search(chain, from_gpus(8, "h100"), Training(global_batch=8), options, n_blocks=4)


def test_fsdp_pinned_and_auto_take_fsdp_where_ddp_does_not_fit() -> None:
    pinned = {"pp": 1, "dp": 8, "micro_batches": 1}
    res = _search(SearchOptions(**pinned, dp_mode="fsdp"))
    assert res.layout.dp_mode == "fsdp" and res.prediction.fits
    assert res.prediction.stages[0].memory.total == pytest.approx(45 * GIB)
    auto = _search(SearchOptions(**pinned, dp_mode="auto"))
    assert {c.dp_mode for c in auto.candidates} == {"ddp", "zero1", "fsdp"}
    assert auto.layout.dp_mode == "fsdp"
    assert auto.prediction.step_ms == pytest.approx(res.prediction.step_ms)
