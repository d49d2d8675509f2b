"""The plan report as one self-contained HTML page: tables, timeline and memory charts."""

from __future__ import annotations

import html
import math
import os
from pathlib import Path

from planner.plan.files import atomic_write
from planner.plan.schema import Plan
from planner.plan.timeline import Event, Timeline, event_name
from planner.report.content import (
    CAND_COLS,
    CAND_NOTE,
    CUT_COLS,
    MEM_COL,
    STAGE_COLS,
    SUMMARY_NOTES,
    Row,
    candidate_rows,
    cut_rows,
    lane_label,
    over_capacity,
    stage_note,
    stage_rows,
    summary,
    tail_label,
    timeline,
)
from planner.report.format import OTHER, STATE, fmt_bytes, fmt_ms, fmt_pct, level

__all__ = ["write_html"]

# Colour and legend of each kind of event (timeline) and part of memory (bars).
_KEY = {
    "F": ("#4c78a8", "forward"),
    "B": ("#f58518", "backward"),
    "send_F": ("#9ecae9", "send activations"),
    "send_B": ("#ffbf79", "send gradients"),
    "reduce": ("#54a24b", "gradient all-reduce across the replicas (DDP)"),
    "tail": ("#8c6d31", "tail"),
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


def _timeline_svg(plan: Plan, tl: Timeline) -> str:
    left, width, row, top = 130, 860, 34, 20
    step = plan.predicted.step_ms
    span = max(tl.step_ms, step, 1e-9)
    height = top + row * tl.n_stages + 22
    out = [f'<svg width="{left + width + 30}" height="{height}" role="img">']
    for t in _ticks(span):
        x = left + t / span * width
        out.append(f'<line x1="{x:.2f}" y1="{top}" x2="{x:.2f}" y2="{height - 16}" stroke="#ddd"/>')
        out.append(f'<text x="{x:.2f}" y="{height - 4}" text-anchor="middle">{t:g} ms</text>')
    for s in range(tl.n_stages):
        out.append(f'<text x="4" y="{top + row * s + 16}">{_e(lane_label(plan, s))}</text>')
    end = left + step / span * width
    out.append(
        f'<line x1="{end:.2f}" y1="{top - 4}" x2="{end:.2f}" y2="{height - 16}" stroke="#c00" '
        f'stroke-width="1.5" stroke-dasharray="4 3"><title>the predicted step ends at '
        f"{_e(fmt_ms(step))} ms</title></line>"
    )
    out.append(
        f'<text x="{end:.2f}" y="{top - 8}" text-anchor="end" fill="#c00">'
        f"step {_e(fmt_ms(step))} ms</text>"
    )
    for e in tl.events:
        x, w = left + e.start / span * width, (e.end - e.start) / span * width
        y, h = _lane_y(e, top, row)
        name = tail_label(plan) if e.kind == "tail" else event_name(e)
        tip = f"stage {e.stage} {name}: {fmt_ms(e.start)}–{fmt_ms(e.end)} ms"
        tip += f" ({fmt_ms(e.end - e.start)} ms)"
        out.append(_rect(x, y, w, h, _KEY.get(e.kind, ("#888", ""))[0], tip))
        if e.kind in ("F", "B") and e.micro_batch >= 0 and w >= 4 + 7 * len(str(e.micro_batch)):
            out.append(
                f'<text x="{x + w / 2:.2f}" y="{y + 14}" text-anchor="middle" fill="#fff">'
                f"{e.micro_batch}</text>"
            )
    return "\n".join([*out, "</svg>"])


def _memory_svg(plan: Plan) -> str:
    left, width, row = 70, 700, 28
    parts: list[tuple[str, tuple[str, ...]]] = [(k, (k,)) for k in (*STATE, "activations")]
    parts.append(("other", OTHER))
    mem = [st.memory for st in plan.stages]
    caps = [m.capacity for m in mem if math.isfinite(m.capacity)]
    scale = 1.05 * max([m.total for m in mem] + caps + [1.0])
    out = [f'<svg width="{left + width + 220}" height="{row * len(mem) + 8}" role="img">']
    for st, m in zip(plan.stages, mem, strict=True):
        total, cap = m.total, m.capacity
        y, x = 4 + row * st.index, float(left)
        out.append(f'<text x="4" y="{y + 14}">stage {st.index}</text>')
        for label, keys in parts:
            v = sum(getattr(m, k) for k in keys)
            w = v / scale * width
            if v > 0:
                tip = f"stage {st.index} {label}: {fmt_bytes(v)}"
                out.append(_rect(x, y, w, 20, _KEY[label][0], tip))
            x += w
        if math.isfinite(cap):
            cx = left + cap / scale * width
            out.append(
                f'<line x1="{cx:.2f}" y1="{y - 3}" x2="{cx:.2f}" y2="{y + 23}" stroke="#000" '
                f'stroke-width="2"><title>capacity {_e(fmt_bytes(cap))}</title></line>'
            )
        share = m.share
        colour = {"over": "#a00", "near": "#8a5a00"}.get(level(share), "#222")
        of = f" of {fmt_bytes(cap)} ({fmt_pct(share)})" if cap < math.inf else ""
        label = fmt_bytes(total) + of
        out.append(f'<text x="{left + width + 8}" y="{y + 14}" fill="{colour}">{_e(label)}</text>')
    return "\n".join([*out, "</svg>"])


def _legend(*keys: str, names: dict[str, str] | None = None) -> str:
    said = names or {}
    spans = (
        f'<span class="key" style="background:{_KEY[k][0]}"></span>{_e(said.get(k, _KEY[k][1]))}'
        for k in keys
    )
    return f'<p class="note">{"".join(spans)}</p>'


def _html_table(cols: list[str], rows: list[Row], mem: int | None = None) -> str:
    head = "".join(f"<th>{_e(c.rstrip('>'))}</th>" for c in cols)
    classes = ["n" if c.endswith(">") else "" for c in cols]
    if mem is not None:
        classes[mem] += " mem"  # coloured by the row's level
    body = []
    for cells, row_level in rows:
        tds = "".join(f'<td class="{c}">{_e(v)}</td>' for v, c in zip(cells, classes, strict=True))
        body.append(f'<tr class="{row_level}">{tds}</tr>')
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _html(plan: Plan) -> str:
    tl, (rows, unit) = timeline(plan), stage_rows(plan)
    title = f"Pipeline plan: {plan.model.file or 'model'}"
    lines = "".join(
        f"<tr><td><b>{_e(k)}</b></td><td>{_e(v)}</td></tr>" for k, v in summary(plan, tl)
    )
    kinds = [k for k in ("F", "B", "send_F", "send_B", "reduce", "tail") if _has(tl, k)]
    sections = [
        f"<h1>{_e(title)}</h1>",
        f'<table class="summary">{lines}</table>',
        f'<p class="note">{_e(SUMMARY_NOTES)}</p>',
        "<h2>Pipeline timeline (one step, simulated)</h2>",
        _legend(*kinds, names={"tail": tail_label(plan)}),
        _timeline_svg(plan, tl),
        '<p class="note">one lane per stage: its replicas (the ranks named) run the same '
        "timeline; the red line is where the plan's predicted step ends</p>",
        "<h2>Memory per device</h2>",
        _legend(*STATE, "activations", "other"),
        _memory_svg(plan),
        '<p class="note">black line: the device\'s usable memory</p>',
        "<h2>Stages</h2>",
        _html_table(STAGE_COLS, rows, MEM_COL),
        f'<p class="note">{_e(stage_note(unit))}</p>',
        _modules(plan),
    ]
    if plan.pp > 1:
        cuts, note = cut_rows(plan)
        sections += ["<h2>What crosses each split point</h2>", _html_table(CUT_COLS, cuts)]
        sections.append(f'<p class="note">{_e(note)}</p>')
    sections += [f'<p class="warn">{_e("over capacity: " + w)}</p>' for w in over_capacity(plan)]
    if plan.candidates:
        sections += ["<h2>Candidates</h2>", _html_table(CAND_COLS, candidate_rows(plan))]
        sections.append(f'<p class="note">{_e(CAND_NOTE)}</p>')
    if plan.warnings:
        items = "".join(f"<li>warning: {_e(w)}</li>" for w in plan.warnings)
        sections += ["<h2>Warnings</h2>", f'<ul class="warn">{items}</ul>']
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{_e(title)}</title><style>{_CSS}</style></head>\n<body>\n"
        + "\n".join(sections)
        + "\n</body></html>\n"
    )


def _has(tl: Timeline, kind: str) -> bool:
    return any(e.kind == kind for e in tl.events)


def _modules(plan: Plan) -> str:
    """Every stage's module calls, each list folded (a click opens it)."""
    items = []
    for st in plan.stages:
        names = "".join(f"<li><code>{_e(m)}</code></li>" for m in st.modules)
        start = st.split_point or "(input)"
        head = f"stage {st.index}: {len(st.modules)} module calls from <code>{_e(start)}</code>"
        items.append(f"<details><summary>{head}</summary><ol>{names}</ol></details>")
    return "<h3>Modules per stage</h3>" + "".join(items)


def write_html(plan: Plan, path: str | os.PathLike[str]) -> Path:
    """Write the report as one self-contained HTML file (inline CSS and SVG).

    Example::

        write_html(plan, "plan.html")   # open it in any browser, offline

    Hovering a box of the timeline or memory chart shows its figures.
    """
    return atomic_write(path, _html(plan))
