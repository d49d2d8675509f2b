"""The calibration fit: figures a run determines are recovered from a run the cost model
itself made with known corrections; the rest are left at their defaults."""

from __future__ import annotations

import dataclasses

import pytest
from models import cpu_cluster, tower_plan

from planner.calibrate import fit, plan_cost_model
from planner.calibrate.compute import (
    SCALE_PRIOR_SD,
    SCALE_RANGE,
    Action,
    bounded_line,
    compute_scales,
)
from planner.calibrate.text import summary
from planner.plan.calibration import calibrated, uncalibrated
from planner.plan.measured import Interval, Measurement, RankRecord, joined
from planner.plan.records import Calibration
from planner.plan.schema import Plan
from planner.plan.text import ERROR_CONVENTION, fmt_error


def run_of(plan: Plan, truth: Calibration, steps: int = 4) -> Measurement:
    """A run of ``plan`` as the cost model with ``truth`` predicts it, recorded as the
    runtime's recorder records one: DDP's all-reduce inside the last backward, the
    optimizer timed on its own, the first step warm-up."""
    devices = {p.device for p in plan.profiles}
    cm = plan_cost_model(plan, {d: truth for d in devices})
    tl = cm.predict([s.blocks[0] for s in plan.stages]).timeline
    m = plan.micro_batches
    records = []
    for st in plan.stages:
        reduce_end = max(
            (e.end for e in tl.events if e.stage == st.index and e.kind == "reduce"), default=0.0
        )
        tail = min(e.start for e in tl.events if e.stage == st.index and e.kind == "tail")
        opt_ms = cm.time.optimizer_ms(st.index, *st.blocks)
        for replica, rank in enumerate(st.ranks):
            ivs: list[Interval] = []
            for k in range(steps):
                t0 = k * (tl.step_ms + 5.0)

                def add(kind: str, mb: int, a: float, b: float, t0: float = t0, k: int = k) -> None:
                    ivs.append(Interval(kind, k, mb, (t0 + a) / 1e3, (t0 + b) / 1e3))  # noqa: B023

                for e in tl.events:
                    if e.stage != st.index or e.kind not in ("F", "B"):
                        continue
                    end = e.end
                    if e.kind == "B" and e.micro_batch == m - 1:
                        end = max(end, reduce_end)
                    add(e.kind, e.micro_batch, e.start, end)
                add("optimizer", -1, tail, tail + opt_ms)
                add("step", -1, 0.0, tl.step_ms)
            records.append(
                RankRecord(
                    rank=rank, replica=replica, stage=st.index, device="x", intervals=tuple(ivs)
                )
            )
    return Measurement(
        records=tuple(records),
        steps=tuple(range(steps)),
        counted=tuple(range(1, steps)),
        global_batch=plan.global_batch,
    )


def _step_scaled(run: Measurement, k: float) -> Measurement:
    return dataclasses.replace(
        run,
        records=tuple(
            dataclasses.replace(
                r,
                intervals=tuple(
                    dataclasses.replace(iv, end=iv.start + k * (iv.end - iv.start))
                    if iv.kind == "step"
                    else iv
                    for iv in r.intervals
                ),
            )
            for r in run.records
        ),
    )


@pytest.fixture(scope="module")
def gpu_plan() -> Plan:
    return tower_plan(4, pp=2, dp=2, micro_batches=4, schedule="1f1b")


@pytest.fixture(scope="module")
def cpu_plan() -> Plan:
    return tower_plan(cluster=cpu_cluster(2), pp=2, dp=1, micro_batches=4, schedule="gpipe")


def test_a_run_made_with_known_corrections_gives_them_back(gpu_plan: Plan) -> None:
    truth = Calibration(
        fwd_scale=1.3,
        bwd_scale=1.3,
        action_overhead_ms=0.4,
        optimizer_scale=2.0,
        allreduce_scale=3.0,
        p2p_extra_ms=0.02,
    )
    got = fit(gpu_plan, run_of(gpu_plan, truth)).calibrations["h100"]
    assert got.fwd_scale == pytest.approx(1.3, rel=1e-6)
    assert got.bwd_scale == pytest.approx(1.3, rel=1e-6)
    assert got.optimizer_scale == pytest.approx(2.0, rel=1e-6)
    assert got.allreduce_scale == pytest.approx(3.0, rel=1e-6)
    assert got.p2p_extra_ms == pytest.approx(0.02, abs=1e-6)
    assert got.action_overhead_ms == pytest.approx(0.4, rel=1e-6)
    assert got.corun_slowdown is None  # GPUs do not share cores: nothing to fit
    assert "corun_slowdown" not in got.fitted
    assert got.after_ms == pytest.approx(got.measured_step_ms, rel=1e-6)
    assert got.before_ms == gpu_plan.predicted.step_ms


def test_scattered_points_are_pulled_toward_the_profile() -> None:
    """A U-Net's 1×1 run (forward 18 % above its profile, backward 0.5 %): the line through
    the two points had a slope of 0.5 and 21 ms fixed per action; pulled by their scatter
    about the ratio, the scale stays near the profile's. Points on a line are not pulled."""
    unet = [(30.67, 36.09), (41.06, 41.27)]
    assert bounded_line(unet) == pytest.approx((0.5, 20.75), abs=0.05)
    ratio = sum(x * y for x, y in unet) / sum(x * x for x, _ in unet)
    scatter = sum((y - ratio * x) ** 2 for x, y in unet)
    s, f = bounded_line(unet, pull=scatter / SCALE_PRIOR_SD**2)
    assert s == pytest.approx(0.985, abs=0.01) and f == pytest.approx(3.35, abs=0.1)
    assert bounded_line([(1.0, 1.7), (2.0, 3.0), (4.0, 5.6)], pull=0.0) == pytest.approx((1.3, 0.4))


def test_the_action_overhead_makes_the_simulated_step_the_measured_one(gpu_plan: Plan) -> None:
    measured = run_of(gpu_plan, Calibration(action_overhead_ms=0.0))
    got = fit(gpu_plan, _step_scaled(measured, 1.5)).calibrations["h100"]
    assert got.action_overhead_ms > 0
    assert got.measured_step_ms == pytest.approx(1.5 * measured.step_ms)
    assert got.after_ms == pytest.approx(got.measured_step_ms, rel=1e-6)


def test_a_step_faster_than_its_compute_lowers_the_compute_scale(gpu_plan: Plan) -> None:
    """The overhead cannot go below 0: a step measured faster than even its fitted compute
    predicts lowers the compute scales, so the fit still reproduces its own run, down to
    SCALE_RANGE's floor and no further."""
    measured = run_of(gpu_plan, Calibration(action_overhead_ms=0.0))
    got = fit(gpu_plan, _step_scaled(measured, 0.8)).calibrations["h100"]
    assert got.action_overhead_ms == 0.0
    assert got.fwd_scale < 1.0 and got.bwd_scale == got.fwd_scale
    assert got.after_ms == pytest.approx(0.8 * measured.step_ms, rel=1e-6)
    floor = fit(gpu_plan, _step_scaled(measured, 0.05)).calibrations["h100"]
    assert floor.fwd_scale == SCALE_RANGE[0]
    assert floor.after_ms > floor.measured_step_ms  # said by the after/measured figures


def test_the_compute_line_is_the_constrained_least_squares_optimum() -> None:
    """Against a fine grid of the feasible (scale, fixed): no point fits better, whatever the
    points and the pull (the two-point case that had clamped a ResNet's scale at 2.0
    among them)."""
    import random

    assert bounded_line([(18.5, 15.0), (23.0, 30.0)]) == pytest.approx((1.11, 0.0), abs=0.01)
    rng = random.Random(7)
    lo, hi = SCALE_RANGE
    for _ in range(40):
        pts = [(rng.uniform(1, 30), rng.uniform(1, 60)) for _ in range(rng.choice([2, 4]))]
        pull = rng.choice([0.0, 10.0, 1000.0])
        s, f = bounded_line(pts, pull)
        assert lo <= s <= hi and f >= 0

        def err(s: float, f: float, pts: list[tuple[float, float]] = pts) -> float:
            return sum((y - s * x - f) ** 2 for x, y in pts) + pull * (s - 1) ** 2  # noqa: B023

        best = min(
            err(lo + (hi - lo) * i / 100, 60 * j / 100) for i in range(101) for j in range(101)
        )
        assert err(s, f) <= best + 1e-9


def test_the_corun_slowdown_of_local_processes_is_fitted(cpu_plan: Plan) -> None:
    truth = Calibration(fwd_scale=1.1, bwd_scale=1.1, corun_slowdown=1.5, action_overhead_ms=0.0)
    got = fit(cpu_plan, run_of(cpu_plan, truth)).calibrations["cpu"]
    assert "corun_slowdown" in got.fitted
    assert got.corun_slowdown == pytest.approx(1.5, abs=0.1)
    assert got.fwd_scale == pytest.approx(1.1, rel=0.1)
    assert got.after_ms == pytest.approx(got.measured_step_ms, rel=1e-6)
    assert "allreduce_scale" not in got.fitted  # dp 1: no all-reduce to measure


def test_a_run_of_another_plan_is_refused(gpu_plan: Plan, cpu_plan: Plan) -> None:
    with pytest.raises(ValueError, match="not a run of this plan"):
        fit(gpu_plan, run_of(cpu_plan, Calibration()))


def test_a_calibrated_profile_is_the_profile_scaled_and_comes_back(cpu_plan: Plan) -> None:
    prof = cpu_plan.profiles[0]
    cal = Calibration(fwd_scale=2.0, bwd_scale=0.5)
    got = calibrated(prof, cal)
    assert got.calibration == cal
    assert got.blocks[0].fwd_ms == pytest.approx(2 * prof.blocks[0].fwd_ms)
    assert got.loss_bwd_ms == pytest.approx(0.5 * prof.loss_bwd_ms)
    back = uncalibrated(calibrated(got, Calibration(fwd_scale=3.0)))
    assert back.calibration is None
    assert back.blocks[0].fwd_ms == pytest.approx(prof.blocks[0].fwd_ms)
    assert type(prof).from_dict(got.to_dict()) == got


def test_the_cost_model_applies_every_figure(gpu_plan: Plan) -> None:
    starts = [s.blocks[0] for s in gpu_plan.stages]
    base = plan_cost_model(gpu_plan).predict(starts)
    cal = Calibration(action_overhead_ms=1.0, p2p_extra_ms=0.5, allreduce_scale=2.0)
    got = plan_cost_model(gpu_plan, {"h100": cal}).predict(starts)
    s0, b0 = got.stages[0], base.stages[0]
    assert s0.fwd_ms == pytest.approx(b0.fwd_ms - 0.05 + 1.0)  # nccl's default overhead
    assert s0.send_fwd_ms == pytest.approx(b0.send_fwd_ms + 0.5)
    assert got.step_ms > base.step_ms


def test_runs_joined_are_fitted_as_one(cpu_plan: Plan) -> None:
    truth = Calibration(fwd_scale=1.1, bwd_scale=1.1, corun_slowdown=1.5, action_overhead_ms=0.0)
    one = run_of(cpu_plan, truth, steps=3)
    two = joined([one, one])
    assert len(two.counted) == 2 * len(one.counted)
    assert len(set(two.steps)) == len(two.steps)
    assert two.step_ms == pytest.approx(one.step_ms)
    got = fit(cpu_plan, two).calibrations["cpu"]
    assert got.corun_slowdown == pytest.approx(1.5, abs=0.1)  # no false overlaps across runs
    with pytest.raises(ValueError, match="not of the same plan"):
        joined([one, dataclasses.replace(one, global_batch=one.global_batch + 1)])


def test_the_report_gives_before_after_and_measured(gpu_plan: Plan) -> None:
    run = run_of(gpu_plan, Calibration(fwd_scale=1.3, bwd_scale=1.3, action_overhead_ms=0.0))
    got = fit(gpu_plan, run)
    text = summary(gpu_plan, run, got, gpu_plan, checked_ms=run.step_ms)
    assert "calibration from a run of pp 2 × dp 2, m 4" in text
    assert "forward, h100" in text and "× 1.30" in text
    assert "co-run slow-down" in text and "kept: this run cannot tell" in text
    assert text.count("ms per micro-batch (before → after | measured)") == 2
    assert "the plan is the same" in text
    check = fmt_error(gpu_plan.predicted.step_ms, run.step_ms, 1)  # the new plan's prediction
    assert "measured (--check" in text and f"error {check}" in text
    assert text.splitlines()[-1] == ERROR_CONVENTION


def test_the_compute_scale_stays_within_its_range_when_times_ignore_the_profile(
    cpu_plan: Plan,
) -> None:
    """Four points whose measured times hardly follow the profiled ones (a U-Net's pipelined
    run): least squares gives a slope near 0; the fit keeps SCALE_RANGE's floor. Points that
    do follow are fitted as they are."""
    raw = plan_cost_model(cpu_plan)
    flat = [
        Action(s, "cpu", kind, ms, profiled, 0.0)
        for s, kind, profiled, ms in [(0, "F", 1.0, 10.0), (0, "B", 2.0, 10.1),
                                      (1, "F", 4.0, 10.0), (1, "B", 8.0, 10.2)]
    ]  # fmt: skip
    _, scales, _ = compute_scales(cpu_plan, flat, ["cpu"], raw, (1.0, 0.0))
    assert scales["cpu"][0] == SCALE_RANGE[0]
    steep = [dataclasses.replace(a, ms=1.3 * a.profiled) for a in flat]
    _, scales, _ = compute_scales(cpu_plan, steep, ["cpu"], raw, (1.0, 0.0))
    assert scales["cpu"][0] == pytest.approx(1.3, rel=1e-6)
    huge = [dataclasses.replace(a, ms=9.0 * a.profiled) for a in flat]
    _, scales, _ = compute_scales(cpu_plan, huge, ["cpu"], raw, (1.0, 0.0))
    assert scales["cpu"][0] == SCALE_RANGE[1]


def test_a_fitted_corun_prices_stages_and_not_replicas(cpu_plan: Plan) -> None:
    """[Note: whose co-run a calibration fits]: a pipeline's fitted co-run changes the
    price of its own layout (dp 1) and not that of a layout with replicas, which keeps
    the default; a run with replicas does not fit one."""
    slow = {"cpu": Calibration(corun_slowdown=1.5)}
    starts = [s.blocks[0] for s in cpu_plan.stages]
    assert plan_cost_model(cpu_plan, slow).step_ms(starts) > plan_cost_model(
        cpu_plan, {"cpu": Calibration()}
    ).step_ms(starts)
    dp_plan = tower_plan(cluster=cpu_cluster(4), pp=2, dp=2, micro_batches=4, schedule="gpipe")
    dp_starts = [s.blocks[0] for s in dp_plan.stages]
    assert plan_cost_model(dp_plan, slow).step_ms(dp_starts) == pytest.approx(
        plan_cost_model(dp_plan, {"cpu": Calibration()}).step_ms(dp_starts)
    )
    truth = Calibration(fwd_scale=1.1, bwd_scale=1.1, corun_slowdown=1.5, action_overhead_ms=0.0)
    got = fit(dp_plan, run_of(dp_plan, truth)).calibrations["cpu"]
    assert "corun_slowdown" not in got.fitted and got.corun_slowdown is None
