"""What ``bench.bench_accuracy`` runs inside its spawned gloo worlds (CPU).

Every public ``*_worker`` runs on every rank of a world started by
``bench._runtime_workers.spawn`` and returns plain data (rank 0's is what the
bench reports). Each case is planned inside the world, by rank 0 while the
other ranks wait in a barrier (idle), right before it runs: a shared VM's speed
drifts over minutes, and so the profile a plan is made from and the steps it is
compared with see the same spell of it. (Timing all of a world's cases in
turn, round by round, was tried: holding a dozen pipelines in the processes
made every step 10-25 % slower.)

[Note: what "peak memory" is] The peak, over a training step, of the bytes held
by live CPU tensors that this rank's stage allocated. torch's profiler reports
every allocation and free of the CPU allocator (``profile_memory``); summing
them from before the model is built to the end of the memory steps gives the
live tensor bytes at every instant (a free counts only if its allocation was
seen, so earlier cases in the same process do not leak in). The peak is taken
over the steps after the second (the first allocates the optimizer state and
the pipeline's buffers, the second rebuilds DDP's gradient buckets) and
includes parameters, gradients, optimizer state, DDP's buckets, saved
activations, the pipeline's send and receive buffers and every temporary. It
leaves out, and reports apart, parameters that modules other than the stage
keep alive ([Note: parameters held outside the stage]); and it excludes the
interpreter, torch's libraries and allocator slack (what a resident-set figure
adds: the process's resident set after the timed steps is reported beside it,
as ``rss_bytes``). It is what the cost model's memory predicts: bytes of
tensors, not of the process. The memory steps run under the profiler and are
not timed; the timed steps follow without it, and without the recorder's own
live-tensor tracking (one Python call per operator: it made U-Net's step 30-55 %
slower and its Adam step 3-5 times, which the step errors had counted as the
cost model's).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

from bench._allocations import census, live_at, live_series, profiled, unheld_bytes
from bench._common import knobs
from bench._runtime_workers import _count_faults, _init, _own_cpu_s, alternate, cpu_busy_s

ROOT = Path(__file__).resolve().parents[1]

_STEP = "bench.step"  # record_function name prefix of a memory step
_CENSUS = "bench.census"  # the census before the measured memory steps
_FIRST_STEADY = 2  # the first memory step whose peak counts


def example_path(name: str) -> str:
    """The model file of ``name``: a bundled example, else a model of the zoo (``tests/zoo``)."""
    bundled = ROOT / "examples" / f"{name}.py"
    return str(bundled if bundled.exists() else ROOT / "tests" / "zoo" / f"{name}.py")


# --------------------------------------------------------------------------- plans


def make_plan(example: str, batch: int, pp: int, dp: int, m: int) -> Any:
    """``plan_model`` pinned to (pp, dp, m) on ``from_gpus(pp·dp)``: local CPU processes.

    Call inside ``knobs(...)`` of the example. Adam (``planner run``'s default); the
    schedule is the planner's choice.
    """
    from planner.devices import from_gpus
    from planner.options import PlanOptions, SearchOptions, Training
    from planner.plan.modelfile import load_model_file
    from planner.planning import plan_model

    mf = load_model_file(example_path(example))
    torch.manual_seed(0)
    model = mf.build()
    b = mf.sample(batch)
    inputs = b.args[0] if len(b.args) == 1 and not b.kwargs else (b.args or b.kwargs)
    return plan_model(
        model,
        (inputs, b.targets),
        cluster=from_gpus(pp * dp),
        loss_fn=mf.loss,
        options=PlanOptions(
            training=Training(global_batch=batch, optimizer="adam"),
            search=SearchOptions(pp=pp, dp=dp, micro_batches=m),
        ),
        model_file=example_path(example),
    )


def cost_model(plan: Any) -> Any:
    """The current cost model for ``plan``'s layout, from the profiles the plan carries
    (with the calibration they carry, if any)."""
    from planner.calibrate import plan_cost_model

    cals = {p.device: p.calibration for p in plan.profiles if p.calibration is not None}
    return plan_cost_model(plan, cals)


def starts_of(plan: Any) -> list[int]:
    return [s.blocks[0] for s in plan.stages]


def with_starts(plan: Any, starts: list[int]) -> Any:
    """``plan`` with its stages moved to ``starts``, re-priced by the current cost model."""
    from planner.planning import predicted, stage_plans

    pred = cost_model(plan).predict(starts)
    stages = stage_plans(pred, plan.profiles[0], [s.ranks for s in plan.stages])
    return dataclasses.replace(plan, stages=stages, predicted=predicted(pred), step=pred.inputs)


def _plan_here(make: Callable[[], Any]) -> tuple[Any, dict[str, float]]:
    """``make()`` on rank 0 while the others wait; every rank gets the result and the
    load meanwhile (others' share of the cores, from /proc/stat)."""
    out: list[Any] = [None]
    if dist.get_rank() == 0:
        b0, o0, t0 = cpu_busy_s(), _own_cpu_s(), time.perf_counter()
        made = make()
        wall = time.perf_counter() - t0
        foreign = max(0.0, (cpu_busy_s() - b0) - (_own_cpu_s() - o0))
        out = [(made, {"plan_s": wall, "foreign_share": foreign / (wall * (os.cpu_count() or 1))})]
    dist.broadcast_object_list(out, src=0)
    return out[0]


# --------------------------------------------------------------------------- running


def _adam(params: Any) -> torch.optim.Optimizer:
    # `planner run`'s default optimizer and learning rate (runtime/launch.py).
    return torch.optim.Adam(params, lr=1e-3)


def _build(example: str, plan: Any) -> tuple[Any, Any]:
    """(ParallelModel, batch) of ``plan`` for the example; the full model is dropped. The
    batch is this replica's, as ``planner run``'s feed hands it (runtime.data)."""
    from planner.plan.modelfile import load_model_file
    from runtime.data import Feed, replica_of
    from runtime.engine import ParallelModel

    mf = load_model_file(example_path(example))
    torch.manual_seed(0)  # the same weights on every rank
    model = mf.build()
    batch = Feed.of(mf, plan, replica=replica_of(plan, dist.get_rank()), seed=0).batch(0)
    pm = ParallelModel.from_plan(
        model, plan, loss_fn=mf.loss, optimizer=_adam, sample=(batch.args, batch.kwargs)
    )
    return pm, batch


def _stepper(pm: Any, batch: Any) -> Callable[[], None]:
    inputs = batch.inputs()  # a dict for keyword inputs (the zoo's transformers models)

    def run() -> None:
        pm.step(inputs, batch.targets)

    return run


def _reference() -> Callable[[], None]:
    """A fixed mix of the examples' work (conv, matmul, elementwise), ~10 ms on 1 thread."""
    gen = torch.Generator().manual_seed(0)
    img = torch.randn(4, 32, 32, 32, generator=gen)
    w = torch.randn(32, 32, 3, 3, generator=gen)
    a = torch.randn(256, 512, generator=gen)
    b = torch.randn(512, 512, generator=gen)
    big = torch.randn(1 << 20, generator=gen)

    def run() -> None:
        for _ in range(3):
            F.conv2d(img, w, padding=1)
            torch.mm(a, b)
            big.mul(1.0001).add_(1.0)

    return run


def corun_check(threads: int, repeats: int = 3) -> dict[str, float]:
    """The reference on rank 0 alone, then on every rank at once (alternating):
    how much this world's processes slow each other down right now."""
    ref = _reference()

    def alone() -> None:
        if dist.get_rank() == 0:
            ref()

    res = alternate({"alone": alone, "all": ref}, repeats=repeats, warmup=1, max_rounds=repeats)
    a = statistics.median(res["times"]["alone"])
    b = statistics.median(res["times"]["all"])
    return {"alone_ms": a * 1e3, "all_ms": b * 1e3, "slowdown": b / a, "threads": threads}


# --------------------------------------------------------------------------- memory


def _mark(pm: Any) -> Callable[[], None]:
    """Name this rank's actions in the profile (F k, B k, optimizer); returns the undo."""
    stage = pm.stage.pipeline_stage
    undo: list[Callable[[], None]] = []

    def wrap(obj: Any, name: str, label: Callable[..., str]) -> None:
        orig = getattr(obj, name)

        def run(*a: Any, **k: Any) -> Any:
            with record_function(label(*a, **k)):
                return orig(*a, **k)

        setattr(obj, name, run)
        undo.append(lambda: delattr(obj, name))

    def chunk(kind: str) -> Callable[..., str]:
        def label(*a: Any, **k: Any) -> str:
            mb = k.get("fwd_chunk_id", k.get("bwd_chunk_id", a[0] if a else "?"))
            return f"bench.{kind}{mb}"

        return label

    wrap(stage, "forward_one_chunk", chunk("F"))
    wrap(stage, "backward_one_chunk", chunk("B"))
    if pm.optimizer is not None:
        wrap(pm.optimizer, "step", lambda *a, **k: "bench.optimizer")

    def restore() -> None:
        for u in reversed(undo):
            u()

    return restore


def memory_pass(example: str, plan: Any, steps: int) -> tuple[Any, Any, dict[str, Any]]:
    """Build the case under the profiler and run ``steps`` steps; the peak of the later ones.

    Returns the ParallelModel and batch (for the timed steps) and this rank's figures.
    """
    from runtime.measure.memory import stage_state_bytes

    # Steady state: the first step allocates the optimizer state and the pipeline's
    # buffers, the second rebuilds DDP's buckets (in gradient-ready order).
    steady = min(_FIRST_STEADY, steps - 1)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("bench.build"):
            pm, batch = _build(example, plan)
        gc.collect()
        with record_function("bench.built"):
            pass
        restore = _mark(pm)
        step = _stepper(pm, batch)
        ddps = [st.wrapped for st in pm.stages if st.ddp]
        for k in range(steps):
            dist.barrier()
            if k == steady:  # [Note: frees on other threads] in bench._allocations
                with record_function(_CENSUS):
                    before = census(ddps)
            with record_function(f"{_STEP}{k}"):
                step()
        after = census(ddps)
        restore()
    events, marks = profiled(prof, "bench.")
    taken = next(a for n, a, _ in marks if n == _CENSUS)
    series = live_series(events, (taken, before))
    points = series.points
    spans = {n: (a, b) for n, a, b in marks if n.startswith(_STEP)}
    step_peaks = [
        max((v for t, v in points if a <= t <= b), default=0)
        for a, b in (spans[f"{_STEP}{k}"] for k in range(steps))
    ]
    lo, hi = spans[f"{_STEP}{steady}"][0], spans[f"{_STEP}{steps - 1}"][1]
    peak, at = 0, lo
    for t, v in points:
        if lo <= t <= hi and v > peak:
            peak, at = v, t
    # Where the peak fell: the innermost action span holding it.
    inside = [
        (b - a, n) for n, a, b in marks if a <= at <= b and not n.startswith((_STEP, _CENSUS))
    ]
    where = min(inside)[1].removeprefix("bench.") if inside else "between actions"
    built = next(a for n, a, _ in marks if n == "bench.built")
    outside = _held_outside(pm, set(series.live))
    return (
        pm,
        batch,
        {
            "peak_bytes": peak - outside,
            "peak_total_bytes": peak,
            "step_peaks_bytes": step_peaks,
            "held_outside_stage_bytes": outside,
            "peak_at": where,
            "live_after_build_bytes": live_at(points, built),
            "live_at_step_start_bytes": live_at(points, lo),
            "unrecorded_free_bytes": series.unrecorded,
            "unseen_free_in_steps_bytes": unheld_bytes(series, after),
            "state_bytes": stage_state_bytes(pm),
            "ddp_bucket_bytes": _ddp_bucket_bytes(pm),
        },
    )


def _held_outside(pm: Any, live: set[int]) -> int:
    """Bytes of parameters and buffers that modules other than this rank's stage hold,
    among the blocks the case allocated (``live``: their addresses).

    [Note: parameters held outside the stage] ``pipeline()`` splits the whole
    model on every rank; the ``PipelineStage`` keeps the split graph, so other
    stages' modules (and copies it made of tied weights) stay alive, never used.
    They are the runtime's, not the stage's: the peak is reported with and
    without them, and the error is on the stage's own.
    """
    own = {
        t.untyped_storage().data_ptr()
        for t in [*pm.stage.module.parameters(), *pm.stage.module.buffers()]
    }
    seen: set[int] = set()
    total = 0
    for obj in gc.get_objects():
        if not isinstance(obj, torch.nn.Module):
            continue
        for t in [*obj._parameters.values(), *obj._buffers.values()]:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            try:
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
            except RuntimeError:  # fake or meta tensors of traced graphs
                continue
            if ptr in live and ptr not in own and ptr not in seen:
                seen.add(ptr)
                total += storage.nbytes()
    return total


def _ddp_bucket_bytes(pm: Any) -> int:
    """Bytes of DDP's gradient buckets, from DDP's own logging data (0 without DDP)."""
    if not pm.stage.ddp:
        return 0
    try:
        data = pm.stage.wrapped._get_ddp_logging_data()
        sizes = str(data.get("bucket_sizes", ""))
        return sum(int(x) for x in sizes.split(",") if x.strip())
    except Exception:  # private API: the figure is informative only
        return -1


# --------------------------------------------------------------------------- accuracy


def accuracy_worker(cases: list[dict[str, Any]], opts: dict[str, Any]) -> list[dict[str, Any]]:
    """Case by case: planned here, its memory measured, then its steps timed (consecutive
    steps of one model, as in training); rank 0 returns the figures."""
    _init()
    out = []
    for case in cases:
        r = _prepare(case, opts)
        corun = corun_check(r["threads"]) if dist.get_world_size() > 1 else None
        faults: list[int] = []
        t0 = time.perf_counter()
        r["times"] = alternate(
            {"step": _count_faults(r["step"], faults)},
            repeats=opts["repeats"],
            warmup=opts["warmup"],
            max_rounds=opts["max_rounds"],
            budget_s=opts["budget_s"],
        )
        r["faults"] = faults
        out.append(_finish(r, opts, corun, time.perf_counter() - t0))
    return out


def _prepare(case: dict[str, Any], opts: dict[str, Any]) -> dict[str, Any]:
    """Plan the case (rank 0), build it and measure its memory; a recorder on it."""
    from planner.devices import from_record
    from runtime.measure import Recorder

    pp, dp, m = case["config"]
    with knobs(case["env"]):
        plan, plan_load = _plan_here(lambda: make_plan(case["example"], case["batch"], pp, dp, m))
        threads = from_record(plan.cluster).devices[0].threads or 1
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        pm, batch, mem = memory_pass(case["example"], plan, opts["memory_steps"])
    return {
        "name": case["name"],
        "plan": plan,
        "plan_load": plan_load,
        "threads": threads,
        "pm": pm,
        "step": _stepper(pm, batch),
        "recorder": Recorder(pm, warmup_steps=opts["warmup"], memory=False),
        "memory": mem,
        "memory_s": time.perf_counter() - t0,
    }


def _finish(
    r: dict[str, Any], opts: dict[str, Any], corun: dict[str, float] | None, timing_s: float
) -> dict[str, Any]:
    """Gather one case's figures on rank 0 (collectives) and free the case."""
    from runtime.measure.memory import resident_bytes

    rec, pm, mem, plan = r.pop("recorder"), r.pop("pm"), r["memory"], r["plan"]
    result = rec.gather()
    mem["rss_bytes"] = resident_bytes()
    rec.close()
    mem["minor_faults_per_step"] = statistics.median(
        r["faults"][opts["warmup"] :] or r["faults"] or [0]
    )
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(
        {"rank": dist.get_rank(), "stage": pm.mesh.stage, "replica": pm.mesh.replica, **mem},
        parts,
        dst=0,
    )
    del pm, r["step"]
    gc.collect()
    dist.barrier()
    if dist.get_rank() != 0:
        return {}
    assert result is not None and parts is not None
    counted = set(result.counted)
    stages = []
    for s in range(plan.pp):
        fig = result.stage_figures(s)
        opt = [
            iv.ms
            for rr in result.records
            if rr.stage == s
            for iv in rr.intervals
            if iv.kind == "optimizer" and iv.step in counted
        ]
        fig["optimizer_ms"] = statistics.median(opt) if opt else 0.0
        stages.append(fig)
    return {
        "name": r["name"],
        "plan": plan,
        "plan_load": r["plan_load"],
        "threads": r["threads"],
        "times": r["times"],
        "corun": corun,
        "recorder_step_ms": result.step_ms,
        "stages": stages,
        "ranks": parts,
        "memory_s": r["memory_s"],
        "timing_s": timing_s,
    }


# --------------------------------------------------------------------------- plan quality


def quality_worker(cases: list[dict[str, Any]], opts: dict[str, Any]) -> list[dict[str, Any]]:
    """Per case: our plan (pp = 2) and the uniform split of it, in the same processes,
    stepping in turn."""
    from planner.search.baselines import uniform

    _init()
    out = []
    for case in cases:
        with knobs(case["env"]):

            def both(case: dict[str, Any] = case) -> dict[str, Any]:
                ours = make_plan(case["example"], case["batch"], 2, 1, case["m"])
                n = len(ours.profiles[0].blocks)
                return {"ours": ours, "uniform": with_starts(ours, list(uniform(n, 2)))}

            plans, plan_load = _plan_here(both)
            torch.set_num_threads(1)
            runs = {k: _build(case["example"], p) for k, p in plans.items()}
            steps = {k: _stepper(pm, b) for k, (pm, b) in runs.items()}
            times = alternate(
                steps,
                repeats=opts["repeats"],
                warmup=opts["warmup"],
                max_rounds=opts["max_rounds"],
                budget_s=opts["budget_s"],
            )
        del runs, steps
        gc.collect()
        out.append({"name": case["name"], "plans": plans, "plan_load": plan_load, "times": times})
    return out
