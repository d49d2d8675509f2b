"""The cost model: memory per stage, communication, recompute, predictions."""

from __future__ import annotations

import pytest

from planner.cluster import from_gpus
from planner.cost import CostModel, Layout, Training, state_bytes
from planner.records import BlockCost, ModelProfile, TiedSet

MB = 2**20


def _profile(n: int = 4, batch: int = 4, tied: bool = False) -> ModelProfile:
    blocks = tuple(
        BlockCost(
            index=k,
            name=f"b{k}",
            modules=(f"b{k}",),
            fwd_ms=1.0 + k,
            bwd_ms=2.0 * (1.0 + k),
            param_bytes=4 * MB,  # 1 Mi fp32 parameters
            activation_bytes=8 * MB,
            output_bytes=MB,
            boundary_bytes=0 if k == 0 else 2 * MB,
        )
        for k in range(n)
    )
    ties = (
        (TiedSet(names=("b0.w", f"b{n - 1}.w"), blocks=(0, n - 1), nbytes=4 * MB),) if tied else ()
    )
    return ModelProfile(
        fingerprint="f",
        source="analytic",
        device="h100",
        batch_size=batch,
        dtype="float32",
        threads=0,
        capture="export",
        blocks=blocks,
        tied=ties,
        input_bytes=MB // 2,
        loss_fwd_ms=0.5,
        loss_bwd_ms=0.25,
    )


def _model(pp=2, dp=1, m=2, schedule="gpipe", prof=None, **train) -> CostModel:
    cluster = from_gpus(pp * dp, "h100")
    ranks = tuple(tuple(r * pp + s for r in range(dp)) for s in range(pp))
    layout = Layout(pp=pp, dp=dp, micro_batches=m, schedule=schedule, ranks=ranks)
    training = Training(global_batch=4 * dp * m, **train)
    return CostModel({"h100": prof or _profile()}, cluster, training, layout)


def test_state_bytes_per_parameter() -> None:
    assert state_bytes("fp32", "adam") == (4, 4, 8)
    assert state_bytes("bf16-mixed", "adamw") == (2, 2, 12)
    assert state_bytes("fp32", "sgd") == (4, 4, 4)
    with pytest.raises(ValueError, match="adam"):
        state_bytes("fp32", "lion")


def test_memory_breakdown_gpipe_holds_every_micro_batch() -> None:
    cm = _model(pp=2, m=2)
    mem = cm.memory(0, 0, 2)
    # 2 Mi parameters: 8 MiB weights, 8 MiB grads, 16 MiB Adam moments.
    assert (mem.params, mem.grads, mem.optimizer) == (8 * MB, 8 * MB, 16 * MB)
    assert mem.comm_buffers == 0  # dp = 1: no DDP buckets
    # Per micro-batch: 16 MiB saved + input (0.5 MiB) + output (1 MiB); × 2 in flight.
    assert mem.activations == 2 * (16 * MB + MB // 2 + MB)
    assert mem.total == pytest.approx(32 * MB + 35 * MB)


def test_1f1b_keeps_fewer_micro_batches_on_later_stages() -> None:
    cm = _model(pp=2, m=8, schedule="1f1b")
    first, last = cm.memory(0, 0, 2), cm.memory(1, 2, 4)
    assert first.activations == 2 * (16 * MB + MB // 2 + MB)  # min(8, pp − 0) = 2
    assert last.activations == 1 * (16 * MB + 2 * MB + MB)  # min(8, pp − 1) = 1


def test_bf16_mixed_and_dp_buckets() -> None:
    cm = _model(pp=1, dp=2, m=1, precision="bf16-mixed")
    mem = cm.memory(0, 0, 4)
    n = 4 * MB  # parameters
    assert (mem.params, mem.grads, mem.optimizer) == (2 * n, 2 * n, 12 * n)
    assert mem.comm_buffers == 2 * n
    assert mem.activations == 1 * (32 * MB + MB // 2 + MB) * 0.5  # bf16 halves fp32 activations


def test_tied_copy_is_charged_to_the_stage_without_the_owner() -> None:
    cm = _model(pp=2, prof=_profile(tied=True))
    assert cm.memory(0, 0, 2).tied_copies == 0  # owns block 0
    assert cm.memory(1, 2, 4).tied_copies == 1 * MB * 16  # 1 Mi params × 16 B
    # Only the stage holding a copy exchanges its gradient (beyond its optimizer step).
    assert cm.sync(1, 2, 4) > cm.optimizer_ms(1, 2, 4)
    assert cm.sync(0, 0, 2) == pytest.approx(cm.optimizer_ms(0, 0, 2))


def test_recompute_only_when_it_is_needed() -> None:
    prof = _profile()
    roomy = _model(pp=2, m=4, prof=prof)
    assert not roomy._recompute(0, 0, 2)
    tight = _model(pp=2, m=4, prof=prof, memory_headroom=0.0)
    cap = 32 * MB + 4 * (MB // 2 + MB) + 16 * MB + 1  # fits only if recomputing
    tight.capacity = [cap, cap]
    assert tight._recompute(0, 0, 2)
    assert tight._bwd(0, 0, 2, True) - tight._bwd(0, 0, 2, False) == pytest.approx(1.0 + 2.0)


def test_cut_and_sync_use_the_cluster_links() -> None:
    cm = _model(pp=2, dp=2, m=2)
    f, b = cm.cut(0, 2)
    link = cm.cluster.p2p_time(0, 1, 2 * MB) * 1e3
    assert f == pytest.approx(link) and b == pytest.approx(link)
    ring = cm.cluster.allreduce_time(cm.layout.ranks[0], 2 * MB * 4) * 1e3
    # Then the optimizer step: 2 Mi params × (2 × (4 + 8) + 4) bytes at HBM speed.
    dev = cm.cluster.devices[0].device
    optim = 2 * MB * 28 / (dev.memory_bandwidth * dev.memory_efficiency) * 1e3
    assert cm.optimizer_ms(0, 0, 2) == pytest.approx(optim)
    assert cm.sync(0, 0, 2) == pytest.approx(ring + optim)


def test_prediction_matches_the_schedule() -> None:
    cm = _model(pp=2, m=4)
    pred = cm.predict((0, 2))
    s0, s1 = pred.stages
    assert (s0.blocks, s1.blocks) == ((0, 2), (2, 4))
    overhead = cm.overhead
    assert s0.fwd_ms == pytest.approx(1 + 2 + overhead)
    assert s1.fwd_ms == pytest.approx(3 + 4 + 0.5 + overhead)  # the loss on the last stage
    assert pred.step_ms == pytest.approx(pred.closed_form_ms)  # gpipe: exact
    assert pred.fits
    assert pred.samples_per_s == pytest.approx(16 / (pred.step_ms / 1e3))


def test_layout_checks_divisibility() -> None:
    layout = Layout(pp=1, dp=2, micro_batches=3, schedule="gpipe", ranks=((0, 1),))
    with pytest.raises(ValueError, match="not divisible by dp × micro-batches = 2 × 3 = 6"):
        layout.micro_batch_size(16)
