"""What a run measured beside what its plan predicted: the comparison table, the measured trace."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from planner.plan.files import atomic_write
from planner.plan.fold import Col, fold, hidden_note, output_width, wrap
from planner.plan.schema import Plan
from planner.plan.text import ERROR_CONVENTION, fmt_error, fmt_ranks
from planner.plan.timeline import ChromeTrace
from planner.plan.units import MIB
from runtime.measure.memory import CPU_METHOD
from runtime.measure.recorder import Measurement

__all__ = ["comparison_table", "trace_json", "write_trace"]


def _f(x: float, digits: int = 2) -> str:
    return "—" if x != x else f"{x:.{digits}f}"


def comparison_table(plan: Plan, result: Measurement, width: int | None = None) -> str:
    """The plan's predictions beside the measured figures, per stage, with the error of each.

    Error = (predicted − measured) / measured (``ERROR_CONVENTION``; −20%: slower or
    larger than predicted), said on the table's last lines.
    Times are per micro-batch (fwd, bwd) and per step; memory is the stage's
    peak in MiB over the counted steps, the most of its replicas; the last line
    says how it was measured (``runtime.measure.memory``: CUDA's allocator, or
    on the CPU the peak of live tensor bytes, by tracked allocations).

    The table fits ``width`` (default: the terminal's, else ``COLUMNS``, else
    100): on a narrow one the step's columns go first, then the ranks, then
    memory, and the last line says which were hidden (``planner.plan.fold``).
    """
    width = width or _width()
    title = (
        f"predicted vs measured: pp {plan.pp} × dp {plan.dp}, {plan.schedule}, "
        f"m {plan.micro_batches} × {plan.micro_batch_size}; "
        f"medians over step(s) {_span(result.counted)}"
    )
    step_pred = plan.predicted.step_ms
    # [Note: DDP's all-reduce runs inside the last backward] With dp > 1 the last
    # micro-batch's backward also all-reduces the stage's gradients (DDP hooks in
    # autograd). The backward column leaves it out when m > 1; with m = 1 it cannot, and
    # adds the predicted all-reduce (reduce_ms; sync_ms holds the optimizer too) (marked *).
    with_sync = plan.dp > 1 and plan.micro_batches == 1
    reduce = plan.step.reduce_ms if plan.step is not None else [s.sync_ms for s in plan.stages]
    skip = plan.micro_batches if plan.dp > 1 and plan.micro_batches > 1 else None
    rows, on = [], plan.stage_ranks
    for st in plan.stages:
        got = result.stage_figures(st.index, skip_last_backward=skip)
        bwd_pred = st.bwd_ms + (reduce[st.index] if with_sync else 0.0)
        # Several stages per rank: the rank's peak, measured and predicted (its stages summed).
        mem_pred = sum(x.memory.total for x in plan.stages if on[x.index] == on[st.index])
        rows.append(
            [
                str(st.index),
                fmt_ranks(st.ranks),
                _f(st.fwd_ms),
                _f(got["fwd_ms"]),
                fmt_error(st.fwd_ms, got["fwd_ms"]),
                _f(bwd_pred) + ("*" if with_sync else ""),
                _f(got["bwd_ms"]),
                fmt_error(bwd_pred, got["bwd_ms"]),
                _f(step_pred, 1),
                _f(got["step_ms"], 1),
                fmt_error(step_pred, got["step_ms"]),
                _f(mem_pred / MIB, 1),
                _f(got["peak_bytes"] / MIB, 1),
                fmt_error(mem_pred, got["peak_bytes"]),
            ]
        )
    # One header line and no rule: the table is read by programs too, column by column.
    table = fold(_COLS, rows, width, rule=False, wrap_headers=False)
    lines = [*wrap(title, width), *table.lines]
    sps_pred = plan.predicted.samples_per_s
    sps = result.samples_per_s
    tail = [
        f"step: predicted {_f(step_pred, 1)} ms, measured {_f(result.step_ms, 1)} ms "
        f"({fmt_error(step_pred, result.step_ms)}); throughput predicted {_f(sps_pred, 0)}, "
        f"measured {_f(sps, 0)} samples/s ({fmt_error(sps_pred, sps)})"
    ]
    tail += _uncounted_steps(result)
    if with_sync:
        tail.append("* backward + DDP gradient all-reduce (1 micro-batch, dp > 1)")
    elif skip:
        tail.append("backward: all but the last micro-batch's (which also all-reduces, dp > 1)")
    tail.append(f"err: {ERROR_CONVENTION} (−: slower or larger than predicted)")
    if plan.virtual > 1:
        tail.append(
            f"{plan.virtual} stages per rank: each stage's step and memory, predicted and "
            "measured, are its rank's (all its stages together)"
        )
    methods = sorted({r.memory_method for r in result.records})
    tail.append(f"memory measured as: {'; '.join(methods)}")
    tail.append(hidden_note(table.hidden, width, "the measured trace (--trace)"))
    lines += [piece for line in tail if line for piece in wrap(line, width)]
    return "\n".join(lines)


# The figures in groups of three (predicted, measured, error); on a narrow terminal the
# step's go first (the same predicted step on every row), then the ranks, then memory.
_COLS = [
    Col("stage", right=True),
    Col("ranks", right=True, drop=2),
    *[
        Col(name, right=True, drop=drop, long=f"{group} {name}" if name != head else "")
        for group, head, drop in (
            ("fwd", "fwd ms", 0),
            ("bwd", "bwd ms", 0),
            ("step", "step ms", 3),
            ("mem", "mem MiB", 1),
        )
        for name in (head, "meas", "err")
    ],
]


def _width() -> int:
    tty = sys.stdout.isatty()
    return output_width(tty, shutil.get_terminal_size().columns if tty else None)


def _span(steps: Sequence[int]) -> str:
    if not steps:
        return "none"
    lo, hi = steps[0] + 1, steps[-1] + 1  # 1-based, as the training log prints them
    return f"{lo}" if lo == hi else f"{lo}–{hi}"


_THREAD_STEP = 1000  # the "step" lane's thread id, below the stage lane


def trace_json(result: Measurement, *, title: str = "measured") -> dict[str, Any]:
    """The recorded intervals as Chrome / Perfetto trace JSON, one process per rank.

    The same format as ``planner.report.trace_events`` (the predicted trace):
    complete ("X") events in microseconds, named "F3" / "B3" on a thread
    "stage k", so a predicted and a measured trace read alike. Each rank's
    process also has a "steps" lane (the step, the optimizer, the tied sum).
    """
    trace = ChromeTrace()
    t0 = min((iv.start for r in result.records for iv in r.intervals), default=0.0)
    for r in result.records:
        pid = r.rank
        stages = sorted({iv.stage for iv in r.intervals if iv.stage >= 0}) or [r.stage]
        named = ", ".join(map(str, stages))
        trace.process(pid, f"rank {r.rank}: replica {r.replica}, stage {named}", r.rank)
        for k, s in enumerate(stages):  # one lane per stage (several when v > 1)
            trace.thread(pid, s, f"stage {s}", k)
        trace.thread(pid, _THREAD_STEP, "steps", len(stages))
        for iv in r.intervals:
            at = iv.stage if iv.stage >= 0 else r.stage
            lane = at if iv.kind in ("F", "B", "W", "loss") else _THREAD_STEP
            name = f"{iv.kind}{iv.micro_batch}" if iv.micro_batch >= 0 else iv.kind
            if iv.kind == "step":
                name = f"step {iv.step + 1}"
            args: dict[str, Any] = {"stage": at, "step": iv.step + 1}
            if iv.micro_batch >= 0:
                args["micro_batch"] = iv.micro_batch
            start, end = (iv.start - t0) * 1e3, (iv.end - t0) * 1e3
            trace.box(pid, lane, name, iv.kind, start, end, args)
    return trace.data(title=title, steps=[s + 1 for s in result.steps])


def write_trace(
    result: Measurement, path: str | os.PathLike[str], *, title: str = "measured"
) -> Path:
    """Write :func:`trace_json` to ``path`` atomically; open it in ui.perfetto.dev."""
    return atomic_write(path, json.dumps(trace_json(result, title=title), ensure_ascii=False))


def _uncounted_steps(result: Measurement) -> list[str]:
    """The steps left out of the times: warm-up, and the steps the peak came from when
    they are not the timed ones (the CPU's tracking slows the steps it runs in:
    ``runtime.measure.recorder``); or that the timed steps were tracked."""
    memory_only = [s for s in result.memory_steps if s not in set(result.counted)]
    warm = [s for s in result.steps if s not in {*result.counted, *memory_only}]
    out = [f"step(s) {_span(warm)}: warm-up, not counted"] if warm else []
    if memory_only:
        out.append(f"step(s) {_span(memory_only)}: memory measured (tracked, slower), not timed")
    elif result.memory_steps and any(p.memory_method == CPU_METHOD for p in result.records):
        out.append(
            f"step(s) {_span(list(result.memory_steps))}: timed while memory was tracked "
            "(slower): run more steps for untracked times, or --no-memory"
        )
    return out
