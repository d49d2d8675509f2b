"""Rendering of a plan: the terminal report, a self-contained HTML page and a Chrome trace.

Everything here needs only the :class:`~planner.plan.Plan`, so ``planner show
plan.yaml`` renders a saved plan as ``planner plan`` rendered the fresh one.
The pipeline timeline is re-simulated from the plan's own per-stage figures
(:func:`timeline`). Pure: no torch.
"""

from __future__ import annotations

import html
import itertools
import json
import math
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from planner.cluster import Cluster
from planner.plan import Plan, StagePlan
from planner.simulate import Event, Timeline, simulate

__all__ = ["print_plan", "timeline", "trace_events", "write_html", "write_trace"]

_GIB = 2**30
_MIB = 2**20
_STATE = ("params", "grads", "optimizer")
_OTHER = ("buffers", "comm_buffers", "tied_copies")
_NEAR = 0.9  # a stage above this share of its device's memory is flagged

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


# --------------------------------------------------------------------------- numbers


def _ms(x: float) -> str:
    """A time in ms: 1234.5, 12.35, 1.234, 0.050, 0.00123."""
    a = abs(x)
    if a == 0 or not math.isfinite(a):
        return f"{x:g}"
    return format(x, ".1f" if a >= 100 else ".2f" if a >= 10 else ".3f" if a >= 0.01 else ".3g")


def _num(x: float) -> str:
    """Three significant figures or so: 123, 12.3, 1.23, 0 (inf when unbounded)."""
    a = abs(x)
    if a == 0 or not math.isfinite(a):
        return f"{x:g}"
    return format(x, ".0f" if a >= 100 else ".1f" if a >= 10 else ".2f")


def _bytes(n: float) -> str:
    return f"{_num(n / _GIB)} GiB" if abs(n) >= _GIB else f"{_num(n / _MIB)} MiB"


def _count(n: float) -> str:
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:g}"


def _pct(x: float, digits: int = 0) -> str:
    return f"{100 * x:.{digits}f} %"


def _ranks(ranks: Sequence[int]) -> str:
    """Ranks in short: "0–7" for a run, "0,2,…,14" for a long stride, else "0,4"."""
    r = list(ranks)
    steps = {b - a for a, b in itertools.pairwise(r)}
    if len(r) >= 3 and steps == {1}:
        return f"{r[0]}–{r[-1]}"
    if len(r) > 4 and len(steps) == 1:
        return f"{r[0]},{r[1]},…,{r[-1]}"
    return ",".join(map(str, r))


def _modules(mods: Sequence[str]) -> str:
    if len(mods) <= 1:
        return f"{mods[0]} (1)" if mods else "(none)"
    return f"{mods[0]} … {mods[-1]} ({len(mods)})"


def _memory(st: StagePlan) -> tuple[float, float, float, float, float]:
    """(params + grads + optimizer, activations, other, total, capacity), bytes."""
    m = st.memory
    state = sum(m.get(k, 0.0) for k in _STATE)
    other = sum(m.get(k, 0.0) for k in _OTHER)
    act = m.get("activations", 0.0)
    return state, act, other, m.get("total", state + act + other), m.get("capacity", math.inf)


def _share(total: float, capacity: float) -> float:
    return total / capacity if 0 < capacity < math.inf else 0.0


def _level(share: float) -> str:
    return "over" if share > 1 else "near" if share > _NEAR else ""


# --------------------------------------------------------------------------- shared content


def _cluster(plan: Plan) -> str:
    try:
        return Cluster.from_dict(plan.cluster).describe()
    except (ValueError, KeyError, TypeError):  # an edited or foreign cluster record
        return str(plan.cluster.get("name", "(unknown cluster)"))


def _solver(plan: Plan) -> str:
    sv = plan.solver
    if sv.status == "optimal":
        text = f"proven optimal in {sv.solve_s:.2f} s"
    elif sv.status == "time_limit":
        limit = sv.time_limit_s if sv.time_limit_s is not None else sv.solve_s
        gap = "unknown" if sv.gap is None else _pct(sv.gap, 1)
        text = f"best found in {limit:g} s, gap {gap}"
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


# --------------------------------------------------------------------------- terminal

_RICH_STYLE = {"over": "bold red", "near": "yellow", "chosen": "bold green"}


def _rich_table(
    title: str, cols: list[str], rows: list[_Row], note: str, mem: int | None = None
) -> Table:
    table = Table(title=title, caption=note)
    for k, col in enumerate(cols):
        # On a narrow terminal, headers and text wrap (folding long names); numbers stay whole.
        name, right = col.rstrip(">"), col.endswith(">")
        whole = max([len(cells[k]) for cells, _ in rows if right and k != mem], default=None)
        table.add_column(name, justify="right" if right else "left", overflow="fold")
        table.columns[-1].min_width = whole
    for cells, level in rows:
        texts = [Text(c) for c in cells]
        if mem is not None and level in ("over", "near"):
            texts[mem].stylize(_RICH_STYLE[level])
        table.add_row(*texts, style=_RICH_STYLE[level] if level == "chosen" else None)
    return table


def print_plan(plan: Plan, *, console: Console | None = None) -> None:
    """Print the plan's summary, stage table, candidates and warnings.

    Example::

        print_plan(load_plan("plan.yaml"))      # what `planner show plan.yaml` prints
    """
    console = console or Console()
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    for label, text in _summary(plan, timeline(plan)):
        grid.add_row(label, Text(text))
    console.print(grid)
    rows, unit = _stage_rows(plan)
    console.print(_rich_table("stages", _STAGE_COLS, rows, _stage_note(unit), _MEM_COL))
    for line in _over_capacity(plan):
        console.print(Text(f"over capacity: {line}", style="bold red"))
    if plan.candidates:
        note = "ranked by the search; the chosen one in bold"
        console.print(_rich_table("candidates", _CAND_COLS, _candidate_rows(plan), note))
    for w in plan.warnings:
        console.print(Text(f"warning: {w}", style="yellow"))


# --------------------------------------------------------------------------- HTML

# Colour and legend of each kind of event (timeline) and part of memory (bars).
_KEY = {
    "F": ("#4c78a8", "forward"),
    "B": ("#f58518", "backward"),
    "send_F": ("#9ecae9", "send activations"),
    "send_B": ("#ffbf79", "send gradients"),
    "sync": ("#54a24b", "gradient all-reduce"),
    "params": ("#4c78a8", "params"),
    "grads": ("#72b7b2", "grads"),
    "optimizer": ("#b279a2", "optimizer"),
    "activations": ("#f58518", "activations"),
    "other": ("#bab0ac", "other"),
}
_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}
table{border-collapse:collapse;margin:6px 0}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f4f4f4}td.n{text-align:right;font-variant-numeric:tabular-nums}
table.summary td{border:none;padding:1px 16px 1px 0}
tr.chosen td{background:#e6f4ea;font-weight:bold}
tr.over td.mem{background:#fdd;color:#a00;font-weight:bold}tr.near td.mem{background:#ffc}
.key{display:inline-block;width:12px;height:12px;margin:0 4px 0 12px;vertical-align:middle}
.note{color:#666;font-size:12px}.warn{color:#8a5a00}svg text{font:11px system-ui,sans-serif}
"""
_e = html.escape


def _rect(x: float, y: float, w: float, h: float, fill: str, tip: str) -> str:
    """A box with a hover tooltip; tall boxes get a white edge to part neighbours."""
    edge = ' stroke="#fff" stroke-width="0.75"' if h >= 20 else ""
    return (
        f'<rect x="{x:.2f}" y="{y:.2f}" width="{max(w, 0.5):.2f}" height="{h}" fill="{fill}"'
        f"{edge}><title>{_e(tip)}</title></rect>"
    )


def _ticks(span: float, n: int = 8) -> list[float]:
    """Round tick values (1, 2, 5 × 10^k apart) from 0 to span."""
    raw = span / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(k * mag for k in (1, 2, 5, 10) if k * mag >= raw)
    return [k * step for k in range(int(span / step + 1e-9) + 1)]


def _lane_y(e: Event, top: float, row: float) -> tuple[float, float]:
    """Where an event is drawn: compute in its stage's row, sends on the link's thin lanes."""
    if e.kind == "send_F":
        return top + row * e.stage + 24, 3
    if e.kind == "send_B":
        return top + row * (e.stage - 1) + 28, 3
    return top + row * e.stage + 2, 20


def _timeline_svg(tl: Timeline) -> str:
    left, width, row, top = 70, 900, 34, 6
    span = tl.step_ms if tl.step_ms > 0 else 1.0
    height = top + row * tl.n_stages + 22
    out = [f'<svg width="{left + width + 30}" height="{height}" role="img">']
    for t in _ticks(span):
        x = left + t / span * width
        out.append(f'<line x1="{x:.2f}" y1="{top}" x2="{x:.2f}" y2="{height - 16}" stroke="#ddd"/>')
        out.append(f'<text x="{x:.2f}" y="{height - 4}" text-anchor="middle">{t:g} ms</text>')
    for s in range(tl.n_stages):
        out.append(f'<text x="4" y="{top + row * s + 16}">stage {s}</text>')
    for e in tl.events:
        x, w = left + e.start / span * width, (e.end - e.start) / span * width
        y, h = _lane_y(e, top, row)
        name = _event_name(e)
        tip = f"stage {e.stage} {name}: {_ms(e.start)}–{_ms(e.end)} ms ({_ms(e.end - e.start)} ms)"
        out.append(_rect(x, y, w, h, _KEY.get(e.kind, ("#888", ""))[0], tip))
        if e.kind in ("F", "B") and e.micro_batch >= 0 and w >= 4 + 7 * len(str(e.micro_batch)):
            out.append(
                f'<text x="{x + w / 2:.2f}" y="{y + 14}" text-anchor="middle" fill="#fff">'
                f"{e.micro_batch}</text>"
            )
    return "\n".join([*out, "</svg>"])


def _memory_svg(plan: Plan) -> str:
    left, width, row = 70, 700, 28
    parts: list[tuple[str, tuple[str, ...]]] = [(k, (k,)) for k in (*_STATE, "activations")]
    parts.append(("other", _OTHER))
    mem = [_memory(st) for st in plan.stages]
    caps = [m[4] for m in mem if math.isfinite(m[4])]
    scale = 1.05 * max([m[3] for m in mem] + caps + [1.0])
    out = [f'<svg width="{left + width + 220}" height="{row * len(mem) + 8}" role="img">']
    for st, (*_, total, cap) in zip(plan.stages, mem, strict=True):
        y, x = 4 + row * st.index, float(left)
        out.append(f'<text x="4" y="{y + 14}">stage {st.index}</text>')
        for label, keys in parts:
            v = sum(st.memory.get(k, 0.0) for k in keys)
            w = v / scale * width
            if v > 0:
                out.append(
                    _rect(x, y, w, 20, _KEY[label][0], f"stage {st.index} {label}: {_bytes(v)}")
                )
            x += w
        if math.isfinite(cap):
            cx = left + cap / scale * width
            out.append(
                f'<line x1="{cx:.2f}" y1="{y - 3}" x2="{cx:.2f}" y2="{y + 23}" stroke="#000" '
                f'stroke-width="2"><title>capacity {_e(_bytes(cap))}</title></line>'
            )
        share = _share(total, cap)
        colour = {"over": "#a00", "near": "#8a5a00"}.get(_level(share), "#222")
        label = _bytes(total) + (f" of {_bytes(cap)} ({_pct(share)})" if cap < math.inf else "")
        out.append(f'<text x="{left + width + 8}" y="{y + 14}" fill="{colour}">{_e(label)}</text>')
    return "\n".join([*out, "</svg>"])


def _legend(*keys: str) -> str:
    spans = (
        f'<span class="key" style="background:{_KEY[k][0]}"></span>{_e(_KEY[k][1])}' for k in keys
    )
    return f'<p class="note">{"".join(spans)}</p>'


def _html_table(cols: list[str], rows: list[_Row], mem: int | None = None) -> str:
    head = "".join(f"<th>{_e(c.rstrip('>'))}</th>" for c in cols)
    classes = ["n" if c.endswith(">") else "" for c in cols]
    if mem is not None:
        classes[mem] += " mem"  # coloured by the row's level
    body = []
    for cells, level in rows:
        tds = "".join(f'<td class="{c}">{_e(v)}</td>' for v, c in zip(cells, classes, strict=True))
        body.append(f'<tr class="{level}">{tds}</tr>')
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _html(plan: Plan) -> str:
    tl, (rows, unit) = timeline(plan), _stage_rows(plan)
    title = f"Pipeline plan: {plan.model.get('file') or 'model'}"
    summary = "".join(
        f"<tr><td><b>{_e(k)}</b></td><td>{_e(v)}</td></tr>" for k, v in _summary(plan, tl)
    )
    sections = [
        f"<h1>{_e(title)}</h1>",
        f'<table class="summary">{summary}</table>',
        "<h2>Pipeline timeline (one step, simulated)</h2>",
        _legend("F", "B", "send_F", "send_B", "sync"),
        _timeline_svg(tl),
        "<h2>Memory per device</h2>",
        _legend(*_STATE, "activations", "other"),
        _memory_svg(plan),
        '<p class="note">black line: the device\'s usable memory</p>',
        "<h2>Stages</h2>",
        _html_table(_STAGE_COLS, rows, _MEM_COL),
        f'<p class="note">{_e(_stage_note(unit))}</p>',
    ]
    sections += [f'<p class="warn">{_e("over capacity: " + w)}</p>' for w in _over_capacity(plan)]
    if plan.candidates:
        sections += ["<h2>Candidates</h2>", _html_table(_CAND_COLS, _candidate_rows(plan))]
    if plan.warnings:
        items = "".join(f"<li>warning: {_e(w)}</li>" for w in plan.warnings)
        sections += ["<h2>Warnings</h2>", f'<ul class="warn">{items}</ul>']
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{_e(title)}</title><style>{_CSS}</style></head>\n<body>\n"
        + "\n".join(sections)
        + "\n</body></html>\n"
    )


def write_html(plan: Plan, path: str | os.PathLike[str]) -> Path:
    """Write the report as one self-contained HTML file (inline CSS and SVG).

    Example::

        write_html(plan, "plan.html")   # open it in any browser, offline

    Hovering a box of the timeline or memory chart shows its figures.
    """
    return _write_atomic(path, _html(plan))


# --------------------------------------------------------------------------- trace


def _event_name(e: Event) -> str:
    """The event's label: "F3", "B3", "send F3", "send B3", "sync"."""
    if e.kind.startswith("send_"):
        return f"send {e.kind[5:]}{e.micro_batch}"
    return e.kind if e.micro_batch < 0 else f"{e.kind}{e.micro_batch}"


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
