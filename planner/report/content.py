"""What every report shows: the plan's step (replayed), the summary, the stage and candidate rows.

The timeline is the plan's own: :func:`timeline` replays the simulation inputs
the plan keeps (``Plan.step``), so the terminal report, the HTML page and the
trace draw exactly the step the plan predicts. A plan of format 1 or 2 keeps
none; its timeline is re-simulated from the per-stage figures, and the summary
says so.
"""

from __future__ import annotations

import math

from planner.cost.simulate import replay, simulate
from planner.devices.cluster_file import from_record
from planner.plan.records import Calibration
from planner.plan.schema import Plan
from planner.plan.sections import DP_MODE_NAMES, dp_mode_suffix
from planner.plan.timeline import Timeline
from planner.plan.units import GIB, MIB
from planner.report.format import (
    fmt_bytes,
    fmt_count,
    fmt_modules,
    fmt_ms,
    fmt_num,
    fmt_pct,
    fmt_ranks,
    level,
)

__all__ = [
    "CAND_COLS",
    "CAND_NOTE",
    "CUT_COLS",
    "MEM_COL",
    "STAGE_COLS",
    "SUMMARY_NOTES",
    "Row",
    "candidate_rows",
    "cut_rows",
    "lane_label",
    "over_capacity",
    "stage_note",
    "stage_rows",
    "summary",
    "tail_label",
    "timeline",
]

Row = tuple[list[str], str]
"""A table row: its cells, and a level: "over" / "near" / "chosen" / ""."""


def timeline(plan: Plan) -> Timeline:
    """The plan's predicted step: its simulation inputs replayed.

    Example::

        tl = timeline(load_plan("plan.yaml"))
        tl.step_ms, tl.bubble_fraction       # the plan's predicted step

    A format 1 or 2 plan records no simulation inputs: its step is
    re-simulated from the per-stage figures (a stage's ``send_ms`` holds both
    directions on the link to the next stage; each direction gets half).
    """
    if plan.step is not None:
        return replay(plan.step)
    st = plan.stages
    half = [s.send_ms / 2 for s in st[:-1]]
    return simulate(
        fwd=[s.fwd_ms for s in st],
        bwd=[s.bwd_ms for s in st],
        micro_batches=plan.micro_batches,
        schedule=plan.schedule,
        link_fwd=half,
        link_bwd=half,
        sync=[s.sync_ms for s in st],
    )


def lane_label(plan: Plan, stage: int) -> str:
    """A timeline lane's name: every replica of a stage runs the same step, so one lane
    stands for all of them, and says which ranks they are."""
    ranks = plan.stages[stage].ranks
    return f"stage {stage} · rank{'s' if len(ranks) > 1 else ''} {fmt_ranks(ranks)}"


def tail_label(plan: Plan) -> str:
    """What a stage's tail is in this plan: the optimizer step, after the tied weights'
    exchange when stages share a tied tensor."""
    tied = plan.step.join if plan.step is not None else None
    if tied is None:  # a format 1 or 2 plan: its tail also holds the all-reduce
        return "all-reduce, tied exchange, optimizer step"
    return "tied-weight exchange + optimizer step" if tied else "optimizer step"


def _cluster(plan: Plan) -> str:
    try:
        return from_record(plan.cluster).describe()
    except ValueError:  # an edited or foreign cluster record
        return plan.cluster.name or "(unknown cluster)"


_METHODS = {
    "milp": "by the step MILP",
    "enumeration": "every placement that could be faster simulated",
    "bounds": "its candidate stages' lower bounds reach it",
    "bound+simulation": "the MILP's bound, and every placement it left simulated",
}


def _solver(plan: Plan) -> str:
    """What is proven, of which number: the step's, or (older plans) the closed form's."""
    sv = plan.solver
    # No wall-clock time: the report shows what the plan file holds, and the file
    # holds nothing that differs between runs ([Note: reproducible plan files]).
    gap = "unknown" if sv.gap is None else fmt_pct(sv.gap, 1)
    bound = "" if sv.bound_ms is None else f"; none can be faster than {fmt_ms(sv.bound_ms)} ms"
    if sv.quantity != "predicted.step_ms":
        what = {"optimal": "proven optimal", "time_limit": f"gap {gap}"}.get(sv.status, sv.status)
        text = (
            f"{what} for the closed form {fmt_ms(plan.predicted.closed_form_ms)} ms, not for "
            f"the step (a format {plan.version} plan: its solver minimised the closed form; "
            "re-plan for a proof about the step)"
        )
    elif sv.status == "optimal":
        how = _METHODS.get(sv.method, sv.method)
        text = "step proven optimal for this configuration" + (f" ({how})" if how else "")
    elif sv.status == "bounded" and sv.method in ("milp", "bounds"):
        text = f"step within {gap} of optimal for this configuration{bound} (no proof: {sv.note})"
    elif sv.status == "bounded":
        text = (
            f"step within {gap} of optimal for this configuration{bound} (stages share the "
            "cores, so the step is not a longest path: the best the search found)"
        )
    else:
        limit = f" in {sv.time_limit_s:g} s" if sv.time_limit_s is not None else ""
        text = f"time limit: best found{limit}, gap {gap}{bound}"
    segments = f"; {sv.n_segments} candidate stages" if sv.n_segments else ""
    return f"{sv.name}: {text}{segments}"


def summary(plan: Plan, tl: Timeline) -> list[tuple[str, str]]:
    """(label, text) lines at the top of every report."""
    model, pred = plan.model, plan.predicted
    step = pred.step_ms
    bubble = fmt_pct(pred.bubble_fraction)
    fp = model.fingerprint[:12] if model.fingerprint else f"none (format {plan.version})"
    name = f"{model.file or '(in memory)'}, fingerprint {fp}"
    batch = f"{plan.micro_batches} micro-batches × {plan.micro_batch_size} samples × dp {plan.dp}"
    rows = [
        ("model", f"{name}, {fmt_count(model.parameters)} parameters"),
        ("cluster", _cluster(plan)),
        (
            "layout",
            f"pp {plan.pp} × dp {plan.dp} = {plan.world_size} devices{_dp_mode(plan.dp_mode)}",
        ),
        ("batch", f"{batch} = global batch {plan.global_batch}"),
        ("schedule", _schedule(plan.schedule, plan.virtual, len(plan.stages))),
        ("training", f"{plan.optimizer}, {plan.precision}"),
        (
            "step",
            f"{fmt_ms(step)} ms predicted, {pred.samples_per_s:,.0f} samples/s, bubble {bubble}",
        ),
    ]
    if not math.isclose(pred.closed_form_ms, step, rel_tol=1e-4):
        rows.append(
            (
                "closed form",
                f"{fmt_ms(pred.closed_form_ms)} ms (Σ work + (m − 1) × the slowest stage + "
                f"the all-reduce, no overlap) vs simulated {fmt_ms(step)} ms",
            )
        )
    if plan.step is None:
        rows.append(
            (
                "re-simulated",
                f"{fmt_ms(tl.step_ms)} ms from the stage figures (the plan keeps no simulation "
                "inputs, as format 1 and 2 plans did not; re-plan for the exact timeline)",
            )
        )
    elif not math.isclose(tl.step_ms, step, rel_tol=1e-9):
        rows.append(
            ("replayed", f"{fmt_ms(tl.step_ms)} ms from the plan's simulation inputs (edited?)")
        )
    rows.append(("solver", _solver(plan)))
    if plan.choice is not None:
        rows.append(("choice", _choice(plan)))
    cals = [(p.device, p.calibration) for p in plan.profiles if p.calibration is not None]
    if cals:
        rows.append(("calibrated", _calibrated(dict(cals))))
    return rows


def _calibrated(cals: dict[str, Calibration]) -> str:
    """The calibration the cost model was corrected with (``planner calibrate``)."""
    c = next(iter(cals.values()))
    speeds = ", ".join(
        f"{dev} forward × {x.fwd_scale:.2f}, backward × {x.bwd_scale:.2f}"
        for dev, x in cals.items()
    )
    parts = [speeds]
    if c.action_overhead_ms is not None:
        parts.append(f"{c.action_overhead_ms:.2f} ms per action")
    if c.corun_slowdown is not None:
        parts.append(f"co-run × {c.corun_slowdown:.2f}")
    if c.p2p_extra_ms:
        parts.append(f"+ {c.p2p_extra_ms:.2f} ms per transfer")
    if c.allreduce_scale != 1.0:
        parts.append(f"all-reduce × {c.allreduce_scale:.2f}")
    if c.optimizer_scale != 1.0:
        parts.append(f"optimizer × {c.optimizer_scale:.2f}")
    return (
        f"{'; '.join(parts)} (planner calibrate, from a run of {c.source}: measured "
        f"{fmt_ms(c.measured_step_ms)} ms, predicted {fmt_ms(c.before_ms)} ms before; "
        "--no-calibration ignores it)"
    )


def _choice(plan: Plan) -> str:
    """Why this configuration: the plan's reason, or (an edited plan) one from its figures.
    A configuration kept over a faster one is never called optimal ([Note: robust band])."""
    ch = plan.choice
    assert ch is not None
    if ch.reason:
        return ch.reason
    f = ch.fastest
    if f is None:
        return f"the fastest predicted step (robust band ±{ch.band_pct:g} %)"
    more = (plan.predicted.step_ms - f.step_ms) / f.step_ms
    return (
        f"chosen over pp {f.pp} × dp {f.dp}{dp_mode_suffix(f.dp_mode)}, "
        f"m {f.micro_batches}, "
        f"{_schedule(f.schedule, f.virtual)} "
        f"({fmt_ms(f.step_ms)} ms, solver status {f.status} for that configuration): "
        f"{100 * more:+.1f} % predicted, within the ±{ch.band_pct:g} % band"
    )


# Column names; ">" marks a right-aligned (numeric) column.
STAGE_COLS = ["stage>", "split point", "modules", "ranks", "device"]
STAGE_COLS += ["fwd ms>", "bwd ms>", "send ms>", "sync ms>"]
STAGE_COLS += ["p+g+opt>", "activations>", "other>", "total / capacity>", "R"]
MEM_COL = STAGE_COLS.index("total / capacity>")
CAND_COLS = ["pp>", "dp>", "m>", "schedule", "step ms>", "status", "reason"]
CAND_NOTE = (
    "ranked: the solved configurations by predicted step, fastest first, then those that did "
    "not fit or were pruned by a lower bound. step: predicted, and (where the plan records a "
    "robust band) the interval step × (1 ± band) that the cost model's measured error allows. "
    "A reason begins with the ranks' layout: "
    "pipeline-inside (each replica's stages on consecutive ranks: stages talk over the "
    "fastest links) or replicas-inside (each stage's replicas on consecutive ranks: its "
    "all-reduce does)"
)
SUMMARY_NOTES = (
    "step: the simulated step of the schedule (every action, transfer, all-reduce and "
    "optimizer step in order); closed form: the flow-shop formula Σ work + (m − 1) × the "
    "slowest stage + the all-reduce, which ignores overlap, shown where it differs; solver: "
    "what is proven about the step, over every contiguous placement of this configuration; "
    "choice: why this configuration, when the search kept the sturdiest within the cost "
    "model's error band of the fastest; calibrated: the corrections `planner calibrate` "
    "fitted to a run of this model, which the cost model applied"
)


def stage_note(unit: str) -> str:
    """The stage table's caption (``unit``: of its memory columns)."""
    return (
        f"memory per device in {unit}; p+g+opt: parameters, gradients, optimizer state; "
        "other: buffers, comm buffers, tied copies; R: recomputes activations in backward"
    )


def stage_rows(plan: Plan) -> tuple[list[Row], str]:
    """The stage table's rows, and the unit of its memory columns."""
    mem = [st.memory for st in plan.stages]
    big = max(max(m.total, m.capacity if math.isfinite(m.capacity) else 0) for m in mem)
    unit, scale = ("GiB", GIB) if big >= GIB else ("MiB", MIB)
    rows = []
    for st, m in zip(plan.stages, mem, strict=True):
        where = [st.split_point if st.index else "(input)", fmt_modules(st.modules)]
        times = [fmt_ms(x) for x in (st.fwd_ms, st.bwd_ms, st.send_ms, st.sync_ms)]
        memory = [fmt_num(x / scale) for x in (m.state, m.activations, m.other)]
        memory.append(
            f"{fmt_num(m.total / scale)} / {fmt_num(m.capacity / scale)} ({fmt_pct(m.share)})"
        )
        cells = [str(st.index), *where, fmt_ranks(st.ranks), st.device, *times, *memory]
        rows.append(([*cells, "R" if st.recompute else ""], level(m.share)))
    return rows, unit


def candidate_rows(plan: Plan) -> list[Row]:
    """The candidate table's rows, the chosen one marked; each step with its interval
    step × (1 ± band) where the plan records a robust band."""
    band = plan.choice.band_pct if plan.choice is not None else 0.0
    rows = []
    for c in plan.candidates:
        step = "—" if c.step_ms is None else fmt_ms(c.step_ms)
        if c.step_ms is not None and band > 0 and plan.choice is not None:
            lo, hi = plan.choice.interval(c.step_ms)
            step += f" ({fmt_ms(lo)}–{fmt_ms(hi)})"
        sched = _schedule(c.schedule, c.virtual)
        dp = str(c.dp) + dp_mode_suffix(c.dp_mode, " ")
        cells = [str(c.pp), dp, str(c.micro_batches), sched, step, c.status, c.reason]
        rows.append((cells, "chosen" if c.status == "chosen" else ""))
    return rows


CUT_COLS = ["stage>", "split point", "tensors received (as traced)", "bytes>", "send ms>"]


def cut_rows(plan: Plan) -> tuple[list[Row], str]:
    """Per split point: the tensors that cross it (from the profile's trace), their bytes
    per micro-batch at the traced size, and the predicted transfer both ways; the note."""
    anchor = plan.profiles[0] if plan.profiles else None
    rows = []
    for st in plan.stages[1:]:
        block = anchor.blocks[st.blocks[0]] if anchor is not None else None
        tensors = ", ".join(block.crossing) if block is not None and block.crossing else "—"
        nbytes = fmt_bytes(block.boundary_bytes) if block is not None else "—"
        send = plan.stages[st.index - 1].send_ms
        rows.append(([str(st.index), st.split_point, tensors, nbytes, fmt_ms(send)], ""))
    traced = (
        f"traced at micro-batch {anchor.batch_size}"
        if anchor is not None
        else "not known: the plan keeps no profile"
    )
    note = (
        f"what stage k receives from stage k − 1, per micro-batch, {traced} (the "
        f"plan's is {plan.micro_batch_size}); its gradients go back the same way; send: both "
        "directions, predicted"
    )
    return rows, note


def over_capacity(plan: Plan) -> list[str]:
    """One line per stage that does not fit its device."""
    out = []
    for st in plan.stages:
        m = st.memory
        if m.share > 1:
            out.append(
                f"stage {st.index} needs {fmt_bytes(m.total)} per device but its {st.device} has "
                f"{fmt_bytes(m.capacity)} ({fmt_pct(m.share)}): it will not fit"
            )
    return out


_DP_MODE_TEXT = {
    "zero1": "each replica holds and steps a share of the optimizer state",
    "fsdp": "each replica holds a shard of every weight, gradient and optimizer state, "
    "the weights gathered whole for the step's forwards and backwards",
}


def _dp_mode(dp_mode: str) -> str:
    """ ", ZeRO-1 (...)" or ", FSDP (...)" after a layout whose replicas shard; "" for DDP."""
    if dp_mode not in _DP_MODE_TEXT:
        return ""
    return f", {DP_MODE_NAMES[dp_mode]} ({_DP_MODE_TEXT[dp_mode]})"


def _schedule(name: str, virtual: int, stages: int = 0) -> str:
    """ "1f1b", or "interleaved-1f1b v 2" (with ``stages``: "…, 2 stages per rank, 8 in all")."""
    if virtual <= 1:
        return name
    if stages:
        return f"{name}, {virtual} stages per rank ({stages} in all)"
    return f"{name} v {virtual}"
