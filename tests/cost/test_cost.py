"""The cost model: memory per stage, communication, recompute, predictions."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace

import pytest
from models import block_cost, cpu_cluster, model_profile, usable_cores

from planner.cost import CostModel, Layout, cpu_speeds, state_bytes
from planner.cost.step_time import allreduce_floor
from planner.devices.build import from_gpus
from planner.options import Training
from planner.plan.records import ModelProfile, TiedSet
from planner.search.partition import partition_problem

MB = 2**20


def _profile(n: int = 4, batch: int = 4, tied: bool = False) -> ModelProfile:
    blocks = [
        block_cost(
            k,
            fwd_ms=1.0 + k,
            bwd_ms=2.0 * (1.0 + k),
            param_bytes=4 * MB,  # 1 Mi fp32 parameters
            activation_bytes=8 * MB,
            boundary_bytes=0 if k == 0 else 2 * MB,
        )
        for k in range(n)
    ]
    ties = (
        (TiedSet(names=("b0.w", f"b{n - 1}.w"), blocks=(0, n - 1), nbytes=4 * MB),) if tied else ()
    )
    return model_profile(
        blocks,
        "h100",
        batch_size=batch,
        tied=ties,
        input_bytes=MB // 2,
        loss_fwd_ms=0.5,
        loss_bwd_ms=0.25,
    )


def _cpu_model(pp=2, dp=1, m=2, acts=8 * MB, cores=2, threads=1, **train) -> CostModel:
    prof = _profile()
    prof = replace(
        prof,
        device="cpu",
        source="measured",
        blocks=tuple(replace(b, activation_bytes=acts) for b in prof.blocks),
    )
    ranks = tuple(tuple(r * pp + s for r in range(dp)) for s in range(pp))
    layout = Layout(pp=pp, dp=dp, micro_batches=m, schedule="gpipe", ranks=ranks)
    training = Training(global_batch=4 * dp * m, **train)
    with usable_cores(cores):
        return CostModel({"cpu": prof}, cpu_cluster(pp * dp, threads), training, layout)


def _model(pp=2, dp=1, m=2, schedule="gpipe", prof=None, **train) -> CostModel:
    cluster = from_gpus(pp * dp, "h100")
    ranks = tuple(tuple(r * pp + s for r in range(dp)) for s in range(pp))
    layout = Layout(pp=pp, dp=dp, micro_batches=m, schedule=schedule, ranks=ranks)
    training = Training(global_batch=4 * dp * m, **train)
    return CostModel({"h100": prof or _profile()}, cluster, training, layout)


def test_state_bytes_per_parameter() -> None:
    assert state_bytes("fp32", "adam") == (4, 4, 8)
    assert state_bytes("bf16-mixed", "adamw") == (4, 4, 8)  # + autocast's bf16 copy: cast_b
    assert state_bytes("fp32", "sgd") == (4, 4, 4)
    with pytest.raises(ValueError, match="adam"):
        state_bytes("fp32", "lion")


# The profile's blocks: 1 Mi fp32 parameters (4 MiB), 8 MiB saved, 1 MiB output,
# 2 MiB crossing each split; 0.5 MiB input. H100s: Adam's foreach temporaries are
# 4 B per parameter. See [Note: the memory peak] in planner/cost/stage_memory.py.


def test_bf16_mixed_prices_what_autocast_keeps() -> None:
    """fp32 weights (+ a bf16 copy), fp32 gradients and moments, bf16 activations and
    all-reduce: [Note: bf16-mixed as it runs] in runtime/precision.py."""
    fp32, bf16 = _model(pp=2, dp=2), _model(pp=2, dp=2, precision="bf16-mixed")
    a, b = fp32.memory(0, 0, 1), bf16.memory(0, 0, 1)
    assert b.params == a.params * (4 + 2) / 4
    assert (b.optimizer, b.comm_buffers) == (a.optimizer, a.comm_buffers)  # fp32 buckets
    assert b.activations < a.activations
    # the gradient all-reduce moves half the bytes (alpha-beta: less than the fp32 one)
    assert 0 < bf16.time.reduce_ms(0, 0, 1) < fp32.time.reduce_ms(0, 0, 1)


def test_memory_peak_gpipe_first_backward() -> None:
    cm = _model(pp=2, m=2)
    mem = cm.memory(0, 0, 2)
    assert (mem.params, mem.optimizer, mem.comm_buffers) == (8 * MB, 16 * MB, 0)
    # Receive buffers: the batch (2 × 0.5) and one output-gradient buffer per
    # micro-batch (2 × 2). The first backward peaks in block 1's: its gradients
    # (4 MiB) and the activations of blocks 0-1 (16), with the other micro-batch's
    # 16 MiB, and the gradients of block 1's output and input (1 + 1) in flight.
    assert mem.grads == 4 * MB
    assert mem.activations == 5 * MB + 16 * MB + 16 * MB + 2 * MB
    assert mem.total == 8 * MB + 16 * MB + 4 * MB + 39 * MB


def test_1f1b_steady_state_and_the_last_stage() -> None:
    cm = _model(pp=2, m=8, schedule="1f1b")
    first, last = cm.memory(0, 0, 2), cm.memory(1, 2, 4)
    # Stage 0: 2 micro-batches in flight, every gradient allocated after the first
    # backward, and a block's new gradient before it is added to the held one (4);
    # receive buffers for all 8 micro-batches (8 × (0.5 + 2)).
    assert first.grads == 8 * MB
    assert first.activations == 20 * MB + 2 * 16 * MB + 2 * MB + 4 * MB
    # Stage 1 (last): 1 in flight holding 16 MiB saved + its output (1: what the loss
    # saved went with the loss's backward, before any block's); 8 input buffers
    # (8 × 2); in backward: block 2's input and output gradients (2 + 1), the previous
    # micro-batch's input gradient being sent (2), and a new parameter gradient (4).
    assert last.grads == 8 * MB
    assert last.activations == 16 * MB + 1 * MB + 16 * MB + 5 * MB + 4 * MB


def test_a_later_backward_meets_an_early_large_block_without_the_later_activations() -> None:
    """The largest block first (an embedding on a language model's first stage): its new
    gradient appears at its own backward, the last of the micro-batch, when the later
    blocks' activations are gone (examples/gpt.py at pp 2, m 4, 1F1B, its first stage:
    90.2 MiB priced at that moment, 85.4 measured at the optimizer step)."""
    prof = _profile()
    blocks = (replace(prof.blocks[0], param_bytes=64 * MB), *prof.blocks[1:])
    mem = _model(pp=2, m=8, schedule="1f1b", prof=replace(prof, blocks=blocks)).memory(0, 0, 2)
    assert mem.grads == 68 * MB
    # Receive buffers 8 × (0.5 + 2), the other micro-batch in flight (16); the one run
    # backward: block 0's activations (8) and its new 64 MiB gradient, not block 1's 8
    # with them; block 1's gradient pair (1 + 1).
    assert mem.activations == 20 * MB + 16 * MB + 8 * MB + 64 * MB + 2 * MB


def test_a_later_loss_backward_makes_no_parameter_gradient() -> None:
    """On the last stage with m > 1, the loss's backward holds every gradient, the output,
    what the loss saved and two output-sized gradients, but no new parameter gradient;
    a block's backward after it holds one, and no longer what the loss saved
    (measured: examples/gpt.py at pp 2, m 4, 1F1B, the last stage's 63.4 MiB peak,
    predicted 71.1 MiB when both were counted at once)."""
    prof = _profile()
    big = prof.blocks[-1]
    blocks = (*prof.blocks[:-1], replace(big, output_bytes=64 * MB))
    cm = _model(pp=2, m=2, schedule="1f1b", prof=replace(prof, blocks=blocks))
    mem = cm.memory(1, 2, 4)
    # Every gradient (8); 1 in flight: saved 16, the output and what the loss saves
    # (2 × 64); 2 input buffers (2 × 2); the loss's two output-sized gradients (2 × 64).
    assert mem.grads == 8 * MB
    assert mem.activations == 16 * MB + 128 * MB + 4 * MB + 128 * MB
    # Smaller outputs: a block's backward is the peak, with its new gradient (4) and
    # without what the loss saved: saved 16, the output 1, buffers 4, the gradients of
    # block 3's output and input (1 + 2), the previous input gradient being sent (2).
    small = _model(pp=2, m=2, schedule="1f1b").memory(1, 2, 4)
    assert small.activations == 16 * MB + 1 * MB + 4 * MB + 3 * MB + 2 * MB + 4 * MB


def test_no_gradient_is_made_for_the_models_inputs() -> None:
    """The first stage's first block makes no gradient of its input: no batch tensor
    requires one (BERT's first stage, one parameter-free block, was priced 1 KiB of it)."""
    mem = _model(pp=2, m=1, prof=replace(_profile(), input_bytes=64 * MB)).memory(0, 0, 1)
    # The batch (64) and one output-gradient buffer (2), block 0's saved 8, and in its
    # backward the gradient of its output (1) alone.
    assert mem.activations == 64 * MB + 2 * MB + 8 * MB + 1 * MB


def test_the_loss_backward_can_be_the_peak() -> None:
    prof = _profile()
    big = prof.blocks[-1]
    blocks = (*prof.blocks[:-1], replace(big, output_bytes=64 * MB))
    cm = _model(pp=2, m=1, prof=replace(prof, blocks=blocks))
    mem = cm.memory(1, 2, 4)
    # No gradients yet; saved 16, the output and what the loss saves (2 × 64), and
    # the loss's two output-sized gradients (2 × 64); one input buffer (2).
    assert mem.grads == 0
    assert mem.activations == 2 * MB + 16 * MB + 128 * MB + 128 * MB


def test_optimizer_step_peak_on_cpu() -> None:
    cm = _cpu_model(pp=1, dp=1, m=1, acts=0)
    mem = cm.memory(0, 0, 4)
    # All 4 Mi gradients, the batch (0.5 MiB) and Adam's per-tensor temporaries on
    # CPU: two of the largest block's parameters (2 × 4 MiB).
    assert mem.grads == 16 * MB
    assert mem.activations == MB // 2 + 8 * MB


def test_bf16_mixed_and_dp_buckets() -> None:
    cm = _model(pp=1, dp=2, m=1, precision="bf16-mixed")
    mem = cm.memory(0, 0, 4)
    n = 4 * MB  # parameters
    assert (mem.params, mem.optimizer) == (6 * n, 8 * n)  # fp32 + bf16 copy; 2 moments
    assert mem.comm_buffers == 4 * n  # DDP's buckets: one fp32 gradient's worth
    # The first backward peaks twice alike: in block 3's (its 4 MiB of gradients, and
    # 35.5 MiB of activations that bf16 halves: the batch, 32 saved, the output, block
    # 3's gradient pair) and in block 0's (every gradient, 16 MiB, block 0's 8 saved):
    # 4 + 17.75 = 16 + 5.75. The first of the two is reported.
    assert mem.grads == 4 * n
    first_backward = n + (MB // 2 + 32 * MB + 1 * MB + 2 * MB) * 0.5
    assert first_backward == mem.grads + mem.activations


def test_tied_copy_is_charged_to_the_stage_without_the_owner() -> None:
    cm = _model(pp=2, m=2, prof=_profile(tied=True))
    assert cm.memory(0, 0, 2).tied_copies == 0  # owns block 0
    # 1 Mi params: weights, gradients and Adam moments (4 + 4 + 8 B).
    assert cm.memory(1, 2, 4).tied_copies == 1 * MB * 16
    # With replicas, DDP's buckets hold the copy's gradient too (2 + 1 Mi × 4 B).
    dp = _model(pp=2, dp=2, m=2, prof=_profile(tied=True))
    assert dp.memory(1, 2, 4).comm_buffers == 12 * MB
    # Both stages holding the tied tensor exchange its gradient, the owner too;
    # a stage holding every user of it exchanges nothing.
    assert cm.sync(1, 2, 4) > cm.time.optimizer_ms(1, 2, 4)
    assert cm.sync(0, 0, 2) > cm.time.optimizer_ms(0, 0, 2)
    assert cm.time.tied_ms(0, 0, 4) == 0.0
    # The exchange is a collective: both stages start their tail together.
    tails = [e for e in cm.predict((0, 2)).timeline.events if e.kind == "tail"]
    assert len(tails) == 2 and tails[0].start == tails[1].start


def test_recompute_only_when_it_is_needed() -> None:
    prof = _profile()
    roomy = _model(pp=2, m=4, prof=prof)
    assert not roomy.recompute(0, 0, 2)
    # Without recompute: 3 more micro-batches × 16 MiB in flight (104 MiB in all);
    # with it they keep nothing beyond their buffers, and the peak moves to a later
    # backward: every gradient (8), the recomputed 16 MiB and a new gradient (4): 64 MiB.
    assert roomy.memory(0, 0, 2).total == 104 * MB
    assert roomy.memory(0, 0, 2, True).total == 64 * MB
    tight = _model(pp=2, m=4, prof=prof, memory_headroom=0.0)
    tight.basis.capacity = [70 * MB, 70 * MB]
    assert tight.recompute(0, 0, 2)
    assert tight.time.bwd(0, 0, 2, True) - tight.time.bwd(0, 0, 2, False) == pytest.approx(
        1.0 + 2.0
    )


def test_a_segment_that_fits_neither_way_is_costed_with_recompute() -> None:
    # 50 MiB: stage 0's blocks 0..2 fit neither without (104) nor with recompute (64).
    cm = _model(pp=2, m=4, prof=_profile(), memory_headroom=0.0)
    cm.basis.capacity = [50 * MB, 50 * MB]
    assert cm.recompute(0, 0, 2)
    problem = partition_problem(cm)
    # Its memory is the smaller figure, and its work at least any part's (the
    # partition heuristic's bisection relies on that).
    assert problem.seg_memory(0, 0, 2) == cm.memory(0, 0, 2, True).total
    assert problem.seg_work(0, 0, 2) >= max(problem.seg_work(0, 0, 1), problem.seg_work(0, 1, 2))


def test_cut_and_sync_use_the_cluster_links() -> None:
    cm = _model(pp=2, dp=2, m=2)
    f, b = cm.time.cut(0, 2)
    link = cm.cluster.p2p_time(0, 1, 2 * MB) * 1e3
    assert f == pytest.approx(link) and b == pytest.approx(link)
    ring = cm.cluster.allreduce_time(cm.layout.ranks[0], 2 * MB * 4) * 1e3
    # Then the agreement's norm reads the gradients (2 Mi × 4 bytes) once, and the
    # optimizer step moves 2 Mi params × (2 × (4 + 8) + 4) bytes, at HBM speed.
    dev = cm.cluster.devices[0].device
    hbm = dev.memory_bandwidth * dev.memory_efficiency
    optim, norm = 2 * MB * 28 / hbm * 1e3, 2 * MB * 4 / hbm * 1e3
    assert cm.time.optimizer_ms(0, 0, 2) == pytest.approx(optim)
    assert cm.time.agree_ms(0, 0, 2) == pytest.approx(norm)
    assert cm.sync(0, 0, 2) == pytest.approx(ring + norm + optim)


def test_strided_tensors_across_a_cut_are_priced_as_a_dense_copy() -> None:
    prof = _profile()
    strided = replace(
        prof,
        blocks=tuple(replace(b, boundary_copy_bytes=b.boundary_bytes // 2) for b in prof.blocks),
    )
    dense, copied = _model(prof=prof), _model(prof=strided)
    dev = dense.cluster.devices[0].device
    copy_ms = 2 * MB * 1e3 / (dev.memory_bandwidth * dev.memory_efficiency)  # 1 MiB read + write
    (f0, b0), (f1, b1) = dense.time.cut(0, 2), copied.time.cut(0, 2)
    assert f1 - f0 == pytest.approx(copy_ms) and b1 - b0 == pytest.approx(copy_ms)
    assert copied.predict((0, 2)).step_ms > dense.predict((0, 2)).step_ms


def test_prediction_matches_the_schedule() -> None:
    cm = _model(pp=2, m=4)
    pred = cm.predict((0, 2))
    s0, s1 = pred.stages
    assert (s0.blocks, s1.blocks) == ((0, 2), (2, 4))
    overhead = cm.time.overhead
    assert s0.fwd_ms == pytest.approx(1 + 2 + overhead)
    assert s1.fwd_ms == pytest.approx(3 + 4 + 0.5 + overhead)  # the loss on the last stage
    assert pred.step_ms == pytest.approx(pred.closed_form_ms)  # gpipe: exact
    assert pred.fits
    assert pred.samples_per_s == pytest.approx(16 / (pred.step_ms / 1e3))


def test_step_ms_is_the_predicted_step_on_every_placement() -> None:
    for cm in (_model(pp=3, m=4), _cpu_model(pp=3, dp=1, m=3, cores=2), _model(pp=2, dp=2)):
        pp = cm.layout.pp
        for cuts in itertools.combinations(range(1, cm.n_blocks), pp - 1):
            starts = (0, *cuts)
            assert cm.step_ms(starts) == cm.predict(starts).step_ms  # the same number
            assert cm.step_ms(starts) == cm.predict(starts).step_ms  # and again, cached
    with pytest.raises(ValueError, match="stage 0 is empty"):
        _model(pp=2).step_ms((0, 0))


def test_layout_checks_divisibility() -> None:
    layout = Layout(pp=1, dp=2, micro_batches=3, schedule="gpipe", ranks=((0, 1),))
    with pytest.raises(ValueError, match="not divisible by dp × micro-batches = 2 × 3 = 6"):
        layout.micro_batch_size(16)


def test_cpu_speeds_share_the_cores() -> None:
    # pp 2 × dp 1 on 2 cores: one stage alone runs at full speed, two co-run.
    assert cpu_speeds(stages=2, processes=2, threads=1, cores=2) == pytest.approx([1.0, 1 / 1.15])
    # pp 2 × dp 2: the replicas of one stage co-run; both stages: 4 processes on 2 cores.
    assert cpu_speeds(stages=2, processes=4, threads=1, cores=2) == pytest.approx(
        [1 / 1.15, 0.5 / 1.15]
    )
    # One process with all the cores.
    assert cpu_speeds(stages=1, processes=1, threads=2, cores=2) == [1.0]


def test_cpu_prediction_simulates_the_shared_cores() -> None:
    cm = _cpu_model(pp=2, dp=2, m=4, cores=2)
    assert cm.time.speeds == pytest.approx([1 / 1.15, 0.5 / 1.15])
    pred = cm.predict((0, 2))
    # Reported per-action times are the steady state's (both stages busy) ...
    s0 = pred.stages[0]
    assert s0.fwd_ms == pytest.approx((1 + 2 + cm.time.overhead) * 2 * 1.15)
    # ... the simulation runs fill and drain (one stage busy) twice as fast, so the
    # step is below the closed form that prices every slot at the steady speed.
    assert pred.step_ms < pred.closed_form_ms
    gpu = _model(pp=2, dp=2, m=4)
    assert gpu.time.speeds == [1.0, 1.0]


def test_cpu_optimizer_step_counts_tensors_and_traffic() -> None:
    cm = _cpu_model(pp=1, dp=1, m=1)
    # [Note: the CPU optimizer step]: Adam, 4 Mi parameters × 72 B at 20 GB/s, and
    # 4 blocks × 2 tensors × 19 ops × 1 µs; one process: full speed.
    want = (4 * MB * 72 / 20e9 + 8 * 19 * 1e-6) * 1e3
    assert cm.time.optimizer_ms(0, 0, 4) == pytest.approx(want)


def test_oversubscribed_cpu_messages_wait_for_a_core() -> None:
    from planner.cost.stage_time import CPU_OVERSUBSCRIBED_WAKEUP_S as WAIT

    four = _cpu_model(pp=2, dp=2, m=4, cores=2)  # 4 processes × 1 thread on 2 cores
    two = _cpu_model(pp=2, dp=1, m=4, cores=2)
    assert four.time.wakeup_s == WAIT and two.time.wakeup_s == 0.0
    # The copies are time-sliced (2.3×), the wait for a core is not ([Note: a wake-up is
    # not time-sliced]): a transfer's one message, a 2-rank ring's two.
    link = four.cluster.p2p_time(0, 1, 2 * MB)
    assert four.time.cut(0, 2)[0] == pytest.approx((link * 2.3 + WAIT) * 1e3)
    ring = four.cluster.allreduce_time((0, 2), four.basis.held_parameters(0, 0, 2) * 4)
    assert four.time.reduce_ms(0, 0, 2) == pytest.approx((ring * 2.3 + 2 * WAIT) * 1e3)


def test_a_stage_without_parameters_all_reduces_nothing() -> None:
    """The runtime wraps no DDP around a stage that holds no parameter: no all-reduce is
    priced for it (a BERT's first stage on local CPUs was priced 9.9 ms of one), and the
    search's floor on the all-reduces leaves such stages' latency out."""
    prof = _profile()
    free = replace(prof, blocks=(replace(prof.blocks[0], param_bytes=0), *prof.blocks[1:]))
    cm = _model(pp=2, dp=2, prof=free)
    assert cm.time.reduce_ms(0, 0, 1) == 0.0
    assert cm.time.reduce_ms(0, 0, 2) > 0.0 and cm.time.reduce_ms(1, 1, 4) > 0.0

    def ring(ranks: Sequence[int], nbytes: float) -> float:  # α 1 ms a rank, 1 ms a MB
        return 1e-3 * len(ranks) + nbytes * 1e-9

    grid = [(0, 1), (2, 3, 4)]
    assert allreduce_floor(ring, grid, 1e6) == pytest.approx(2 + 3 + 1)
    assert allreduce_floor(ring, grid, 1e6, free=1) == pytest.approx(2 + 1)  # the costliest α
    assert allreduce_floor(ring, grid, 1e6, free=5) == pytest.approx(2 + 1)  # never all
    assert allreduce_floor(ring, grid, 0.0) == 0.0
