"""Shared by every report: the re-simulated timeline, the summary and tables, the atomic write."""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

from planner.cluster import Cluster
from planner.plan import Plan
from planner.report._format import (
    _GIB,
    _MIB,
    _bytes,
    _count,
    _level,
    _memory,
    _modules,
    _ms,
    _num,
    _pct,
    _ranks,
    _share,
)
from planner.simulate import Timeline, simulate

_Row = tuple[list[str], str]  # cells, and a level: "over" / "near" / "chosen" / ""


def timeline(plan: Plan) -> Timeline:
    """Re-simulate one step of the plan's schedule from its per-stage figures.

    Example::

        tl = timeline(load_plan("plan.yaml"))
        tl.step_ms, tl.bubble_fraction

    A stage's ``send_ms`` holds both directions on the link to the next stage
    (activations forward, gradients back); the cost model prices them alike,
    so each direction gets half.
    """
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


def _cluster(plan: Plan) -> str:
    try:
        return Cluster.from_dict(plan.cluster).describe()
    except (ValueError, KeyError, TypeError):  # an edited or foreign cluster record
        return str(plan.cluster.get("name", "(unknown cluster)"))


def _solver(plan: Plan) -> str:
    sv = plan.solver
    # No wall-clock time: the report shows what the plan file holds, and the file
    # holds nothing that differs between runs ([Note: reproducible plan files]).
    gap = "unknown" if sv.gap is None else _pct(sv.gap, 1)
    if sv.status == "optimal":
        text = "proven optimal"
    elif sv.status == "time_limit":
        limit = f" in {sv.time_limit_s:g} s" if sv.time_limit_s is not None else ""
        text = f"best found{limit}, gap {gap}"
    elif sv.status == "heuristic":
        text = f"the heuristic's placement (the solver found none better), gap {gap}"
    else:
        text = sv.status
    if sv.bound_ms is not None and sv.status != "optimal":
        text += f", lower bound {_ms(sv.bound_ms)} ms"
    text = f"{sv.name}: {text}" + (f" ({sv.n_segments} segments)" if sv.n_segments else "")
    return text + (f"; {sv.note}" if sv.note else "")


def _summary(plan: Plan, tl: Timeline) -> list[tuple[str, str]]:
    """(label, text) lines at the top of every report."""
    model, pred = plan.model, plan.predicted
    step = pred.get("step_ms", tl.step_ms)
    samples = pred.get("samples_per_s", plan.global_batch / (step / 1e3) if step else math.inf)
    bubble = _pct(pred.get("bubble_fraction", tl.bubble_fraction))
    fp, n_params = str(model.get("fingerprint", "")), float(model.get("parameters", 0))
    name = f"{model.get('file') or '(in memory)'}, fingerprint {fp[:12]}"
    batch = f"{plan.micro_batches} micro-batches × {plan.micro_batch_size} samples × dp {plan.dp}"
    rows = [
        ("model", f"{name}, {_count(n_params)} parameters"),
        ("cluster", _cluster(plan)),
        ("layout", f"pp {plan.pp} × dp {plan.dp} = {plan.world_size} devices"),
        ("batch", f"{batch} = global batch {plan.global_batch}"),
        ("schedule", plan.schedule),
        ("training", f"{plan.optimizer}, {plan.precision}"),
        ("step", f"{_ms(step)} ms predicted, {samples:,.0f} samples/s, bubble {bubble}"),
    ]
    closed = pred.get("closed_form_ms")
    if closed is not None and not math.isclose(closed, step, rel_tol=1e-4):
        rows.append(("closed form", f"{_ms(closed)} ms vs simulated {_ms(step)} ms"))
    if not math.isclose(tl.step_ms, step, rel_tol=1e-3):
        rows.append(("re-simulated", f"{_ms(tl.step_ms)} ms from the stage figures (edited?)"))
    rows.append(("solver", _solver(plan)))
    return rows


# Column names; ">" marks a right-aligned (numeric) column.
_STAGE_COLS = ["stage>", "split point", "modules", "ranks", "device"]
_STAGE_COLS += ["fwd ms>", "bwd ms>", "send ms>", "sync ms>"]
_STAGE_COLS += ["p+g+opt>", "activations>", "other>", "total / capacity>", "R"]
_MEM_COL = _STAGE_COLS.index("total / capacity>")
_CAND_COLS = ["pp>", "dp>", "m>", "schedule", "step ms>", "status", "reason"]


def _stage_note(unit: str) -> str:
    return (
        f"memory per device in {unit}; p+g+opt: parameters, gradients, optimizer state; "
        "other: buffers, comm buffers, tied copies; R: recomputes activations in backward"
    )


def _stage_rows(plan: Plan) -> tuple[list[_Row], str]:
    """The stage table's rows, and the unit of its memory columns."""
    mem = [_memory(st) for st in plan.stages]
    big = max(max(m[3], m[4] if math.isfinite(m[4]) else 0) for m in mem)
    unit, scale = ("GiB", _GIB) if big >= _GIB else ("MiB", _MIB)
    rows = []
    for st, (state, act, other, total, cap) in zip(plan.stages, mem, strict=True):
        share = _share(total, cap)
        where = [st.split_point if st.index else "(input)", _modules(st.modules)]
        times = [_ms(x) for x in (st.fwd_ms, st.bwd_ms, st.send_ms, st.sync_ms)]
        memory = [_num(x / scale) for x in (state, act, other)]
        memory.append(f"{_num(total / scale)} / {_num(cap / scale)} ({_pct(share)})")
        cells = [str(st.index), *where, _ranks(st.ranks), st.device, *times, *memory]
        rows.append(([*cells, "R" if st.recompute else ""], _level(share)))
    return rows, unit


def _candidate_rows(plan: Plan) -> list[_Row]:
    rows = []
    for c in plan.candidates:
        step = "—" if c.step_ms is None else _ms(c.step_ms)
        cells = [str(c.pp), str(c.dp), str(c.micro_batches), c.schedule, step, c.status, c.reason]
        rows.append((cells, "chosen" if c.status == "chosen" else ""))
    return rows


def _over_capacity(plan: Plan) -> list[str]:
    out = []
    for st in plan.stages:
        *_, total, cap = _memory(st)
        if _share(total, cap) > 1:
            out.append(
                f"stage {st.index} needs {_bytes(total)} per device but its {st.device} has "
                f"{_bytes(cap)} ({_pct(_share(total, cap))}): it will not fit"
            )
    return out


def _write_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to a temporary file beside ``path``, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a report is for reading
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
