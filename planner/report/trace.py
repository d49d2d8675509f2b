"""The predicted step as a Chrome / Perfetto trace: one thread per stage and link."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from planner.plan import Plan
from planner.report._content import _write_atomic, timeline
from planner.report._format import _event_name
from planner.simulate import Event, Timeline


def _thread(e: Event, n_stages: int) -> tuple[int, str, int]:
    """(tid, thread name, sort index): stage k, then its links k→k+1 and k+1→k below it."""
    if e.kind == "send_F":
        k = e.stage
        return n_stages + 2 * k, f"link {k}→{k + 1}", 3 * k + 1
    if e.kind == "send_B":
        k = e.stage - 1
        return n_stages + 2 * k + 1, f"link {k + 1}→{k}", 3 * k + 2
    return e.stage, f"stage {e.stage}", 3 * e.stage


def _meta(what: str, pid: int, tid: int, **args: Any) -> dict[str, Any]:
    """A metadata ("M") event: names and orders processes and threads."""
    return {"name": what, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _us(ms: float) -> float:
    return round(ms * 1e3, 3)


def trace_events(timeline: Timeline, *, process_name: str, pid: int = 0) -> dict[str, Any]:
    """A timeline as Chrome / Perfetto trace JSON (open in ui.perfetto.dev or chrome://tracing).

    Example::

        json.dumps(trace_events(timeline(plan), process_name="predicted"))

    One thread per stage ("stage k") and per link direction ("link k→k+1",
    "link k+1→k"), so transfers never overlap compute boxes; each event is a
    complete ("X") event, ``ts`` and ``dur`` in microseconds.
    """
    threads = {s: (f"stage {s}", 3 * s) for s in range(timeline.n_stages)}
    boxes = []
    for e in timeline.events:
        tid, name, order = _thread(e, timeline.n_stages)
        threads[tid] = (name, order)
        args = {"stage": e.stage} | ({"micro_batch": e.micro_batch} if e.micro_batch >= 0 else {})
        box = {"name": _event_name(e), "cat": e.kind, "ph": "X", "pid": pid, "tid": tid}
        boxes.append(box | {"ts": _us(e.start), "dur": _us(e.end - e.start), "args": args})
    meta = [_meta("process_name", pid, 0, name=process_name)]
    for tid, (name, order) in sorted(threads.items()):
        meta.append(_meta("thread_name", pid, tid, name=name))
        meta.append(_meta("thread_sort_index", pid, tid, sort_index=order))
    return {"traceEvents": meta + boxes, "displayTimeUnit": "ms"}


def write_trace(plan: Plan, path: str | os.PathLike[str]) -> Path:
    """Write the plan's predicted step as a Chrome / Perfetto trace (JSON).

    Example::

        write_trace(plan, "plan.trace.json")   # drag into ui.perfetto.dev
    """
    model = plan.model.get("file") or "model"
    name = f"predicted {plan.schedule}, pp {plan.pp} × dp {plan.dp}: {model}"
    data = trace_events(timeline(plan), process_name=name)
    data["otherData"] = {"fingerprint": plan.fingerprint, "step_ms": plan.predicted.get("step_ms")}
    return _write_atomic(path, json.dumps(data, ensure_ascii=False))
