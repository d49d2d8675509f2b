"""The predicted step as a Chrome / Perfetto trace: one thread per stage and link."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from planner.plan.files import atomic_write
from planner.plan.schema import Plan
from planner.plan.timeline import ChromeTrace, Event, Timeline, event_name
from planner.report.content import lane_label, tail_label, timeline

__all__ = ["trace_events", "write_trace"]


def _thread(e: Event, n_stages: int) -> tuple[int, str, int]:
    """(tid, thread name, sort index): stage k, then its links k→k+1 and k+1→k below it."""
    if e.kind == "send_F":
        k = e.stage
        return n_stages + 2 * k, f"link {k}→{k + 1}", 3 * k + 1
    if e.kind == "send_B":
        k = e.stage - 1
        return n_stages + 2 * k + 1, f"link {k + 1}→{k}", 3 * k + 2
    return e.stage, f"stage {e.stage}", 3 * e.stage


def trace_events(
    tl: Timeline,
    *,
    process_name: str,
    pid: int = 0,
    lanes: Sequence[str] = (),
    names: Mapping[str, str] | None = None,
    step_ms: float | None = None,
) -> dict[str, Any]:
    """A timeline as Chrome / Perfetto trace JSON (open in ui.perfetto.dev or chrome://tracing).

    Example::

        json.dumps(trace_events(timeline(plan), process_name="predicted"))

    One thread per stage (``lanes[k]``, default "stage k") and per link
    direction ("link k→k+1", "link k+1→k"), so transfers never overlap compute
    boxes; each event is a complete ("X") event, ``ts`` and ``dur`` in
    microseconds, named by :func:`event_name` or ``names[kind]``. ``step_ms``:
    an instant event "step ends" marks it.
    """
    said = names or {}
    threads = {s: (lanes[s] if s < len(lanes) else f"stage {s}", 3 * s) for s in range(tl.n_stages)}
    trace = ChromeTrace()
    trace.process(pid, process_name)
    boxes = []
    for e in tl.events:
        tid, name, order = _thread(e, tl.n_stages)
        threads.setdefault(tid, (name, order))
        args = {"stage": e.stage} | ({"micro_batch": e.micro_batch} if e.micro_batch >= 0 else {})
        boxes.append((tid, e, args))
    for tid, (name, order) in sorted(threads.items()):
        trace.thread(pid, tid, name, order)
    for tid, e, args in boxes:
        trace.box(pid, tid, said.get(e.kind) or event_name(e), e.kind, e.start, e.end, args)
    if step_ms is not None:
        trace.instant(pid, "step ends", step_ms, {"step_ms": step_ms})
    return trace.data()


def write_trace(plan: Plan, path: str | os.PathLike[str]) -> Path:
    """Write the plan's predicted step as a Chrome / Perfetto trace (JSON).

    Example::

        write_trace(plan, "plan.trace.json")   # drag into ui.perfetto.dev
    """
    model = plan.model.file or "model"
    name = f"predicted {plan.schedule}, pp {plan.pp} × dp {plan.dp}: {model}"
    data = trace_events(
        timeline(plan),
        process_name=name,
        lanes=[lane_label(plan, s) for s in range(plan.pp)],
        names={"tail": tail_label(plan)},
        step_ms=plan.predicted.step_ms,
    )
    data["otherData"] = {"fingerprint": plan.fingerprint, "step_ms": plan.predicted.step_ms}
    return atomic_write(path, json.dumps(data, ensure_ascii=False))
