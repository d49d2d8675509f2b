"""Bad-input cases 7-11: memory that does not fit, and layouts that cannot be (stages, batch,
micro-batches)."""

from __future__ import annotations

import re

from bad_input_kit import (
    A100,
    GIB,
    MLP,
    STACK,
    WIDE,
    Env,
    cluster_file,
)

from planner.solve.problem import format_bytes

# --------------------------------------------------------------------------- 7, 8. memory


def test_case07_does_not_fit_even_on_all_devices(env: Env) -> None:
    # Each layer fits one device (1.4 MiB usable), two do not; 4 layers on 2 devices.
    cluster = env.write(cluster_file(0.0015), "cluster.yaml")
    err = env.refused(env.write(STACK), "--cluster", cluster)
    usable = format_bytes(0.0015 * GIB * 0.9)
    assert re.search(r"no configuration fits in memory: (\d+) of \1 candidate\(s\) ran out", err)
    # Per candidate: what each stage needs against what each device has.
    assert re.search(
        r"pp 2 × dp 1, 1 micro-batch \(gpipe\), pipeline-inside: the blocks do not fit in the "
        rf"memory of 2 stages: .* leaves blocks 1\.\.3 \('1'\.\.'3'\) for stage 1, needing "
        rf"[\d.]+ MiB against {re.escape(usable)}",
        err,
    ), err
    assert "the blocks do not fit in the memory of one stage: blocks 0..3 ('0'..'3') need" in err
    assert re.search(r"The largest block is block \d \('\d'\): alone on a stage it needs", err)
    assert f"against {usable} usable per device (10% kept free)" in err
    assert (
        "All 4 blocks hold 4.0 MiB of parameters, gradients and optimizer state (adam, fp32)" in err
    )
    assert f"the 2 devices hold {format_bytes(2 * 0.0015 * GIB * 0.9)} usable in all" in err
    assert "Fix: more devices or devices with more memory" in err
    assert "fewer samples per micro-batch" in err and "recompute" in err


def test_case08_one_block_larger_than_a_device(env: Env) -> None:
    cluster = env.write(cluster_file(0.002), "cluster.yaml")
    err = env.refused(env.write(WIDE), "--cluster", cluster)
    usable = format_bytes(0.002 * GIB * 0.9)
    assert re.search(
        rf"no stage can hold block 1 \('wide'\) within {re.escape(usable)}: it needs 5\.\d MiB "
        rf"on stage \d \(capacity {re.escape(usable)}\)",
        err,
    ), err
    assert "The largest block is block 1 ('wide'): alone on a stage it needs 5." in err
    assert "Fix: more devices or devices with more memory" in err


# --------------------------------------------------------------------------- 9, 10, 11. layout


def test_case09_more_stages_than_split_points(env: Env) -> None:
    model = env.write(MLP)
    err = env.refused(model, "--gpus", 8, *A100, "--pp", 8)
    assert (
        "pp 8 > 5: the model has 5 block(s) that can start a stage (4 legal split point(s)), "
        "so at most 5 stage(s)"
    ) in err
    assert "Fix: --pp 5 or fewer (or leave --pp unset)" in err
    # Unpinned, the search caps the depth instead.
    plan, _ = env.planned(model, "--gpus", 8, *A100)
    assert plan.pp <= 5 and all(c.pp <= 5 for c in plan.candidates)


def test_case10_batch_not_divisible(env: Env) -> None:
    model = env.write(MLP)
    err = env.refused(model, "--gpus", 4, *A100, "--pp", 1, "--dp", 4, "--batch-size", 30)
    assert "no configuration is possible for batch 30 on 4 devices" in err
    assert "batch 30 not divisible by dp 4 (30 / 4 = 7.5)" in err
    assert "Fix: --batch-size 28 or 32 (multiples of dp 4), or a --dp that divides 30" in err
    err = env.refused(
        model, "--gpus", 2, *A100, "--pp", 1, "--micro-batches", 4, "--batch-size", 20
    )
    assert "replica batch 10 (= 20 / dp 2) not divisible by 4 micro-batches (10 / 4 = 2.5)" in err
    assert "--micro-batches among 1, 2, 5, 10" in err
    assert "--batch-size 16 or 24 (multiples of dp × micro-batches = 2 × 4)" in err


def test_case11_fewer_micro_batches_than_stages_warns(env: Env) -> None:
    plan, out = env.planned(env.write(MLP), "--gpus", 2, *A100, "--pp", 2, "--micro-batches", 1)
    [warning] = [w for w in plan.warnings if "bubble" in w]
    bubble = f"{plan.predicted.bubble_fraction:.0%}"
    assert warning.startswith(f"1 micro-batch for 2 stages: the pipeline bubble is {bubble}")
    assert "at least 2 micro-batches (--micro-batches 2" in warning
    assert "warning: 1 micro-batch for 2 stages" in out
