"""The plan report on the terminal: a summary, the stage, split-point and candidate
tables, warnings; laid out to the console's width (:mod:`planner.plan.fold`)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from planner.plan.fold import Col, fold, hidden_note, wrap
from planner.plan.schema import Plan
from planner.report.content import (
    CAND_COLS,
    CAND_NOTE,
    CUT_COLS,
    MEM_COL,
    STAGE_COLS,
    Row,
    candidate_rows,
    cut_rows,
    over_capacity,
    stage_note,
    stage_rows,
    summary,
    timeline,
)

__all__ = ["print_plan", "print_table"]

_RICH_STYLE = {"over": "bold red", "near": "yellow", "chosen": "bold green"}

# Which columns a narrow terminal hides first (higher: earlier; 0: the last to go).
# The step's figures and each stage's fit are what a plan is read for; the memory
# breakdown, the device (the summary names the cluster) and the module list after them.
_STAGE_DROP = {
    "split point": 3,
    "modules": 5,
    "ranks": 4,
    "device": 8,
    "send ms": 2,
    "sync ms": 2,
    "p+g+opt": 6,
    "activations": 6,
    "other": 9,
    "R": 7,
}
_CAND_DROP = {"status": 1, "reason": 2}
_CUT_DROP = {"tensors received (as traced)": 2, "bytes": 1, "send ms": 1}


def columns(names: list[str], drop: dict[str, int]) -> list[Col]:
    """``Col``s from the report's column names (">": a number) and drop priorities."""
    return [
        Col(n.rstrip(">"), right=n.endswith(">"), drop=drop.get(n.rstrip(">"), 0)) for n in names
    ]


def print_table(
    console: Console,
    title: str,
    cols: list[Col],
    rows: list[Row],
    note: str,
    mem: int | None = None,
    where: str = "the HTML report",
) -> None:
    """One table at the console's width: the title, the folded table (rows styled by
    level: the chosen one bold, a memory cell over or near capacity red or yellow), the
    caption, and which columns were hidden, if any (and ``where`` to see them all).

    Example::

        print_table(Console(width=80), "stages", [Col("stage", right=True)], [(["0"], "")], "")
    """
    width = console.width
    table = fold(cols, [cells for cells, _ in rows], width)
    if title:
        console.print(Text(title, style="bold"))
    for line, r, cells in zip(table.lines, table.rows, table.cells, strict=True):
        text = Text(line)
        if r is not None:
            level = rows[r][1]
            if level == "chosen":
                text.stylize(_RICH_STYLE[level])
            elif mem is not None and level in ("over", "near") and mem in table.keep:
                i = table.keep.index(mem)
                cell = cells[i]
                end = table.offsets[i] + table.widths[i]  # a number: right-aligned
                text.stylize(_RICH_STYLE[level], end - len(cell), end)
        console.print(text, no_wrap=True, overflow="ignore", crop=False)
    for line in wrap(note, width) if note else []:
        console.print(Text(line, style="dim"), no_wrap=True)
    hidden = hidden_note(table.hidden, width, where)
    for line in wrap(hidden, width) if hidden else []:
        console.print(Text(line, style="dim"), no_wrap=True)


def _stage_cols(plan: Plan) -> list[Col]:
    drop = dict(_STAGE_DROP)
    if len({st.device for st in plan.stages}) > 1:
        drop["device"] = 3  # devices differ: which stage runs where matters
    if any(st.recompute for st in plan.stages):
        drop["R"] = 1  # a stage recomputes: say which
    return columns(STAGE_COLS, drop)


def print_plan(plan: Plan, *, console: Console | None = None) -> None:
    """Print the plan's summary, stage table, split points, candidates and warnings.

    Example::

        print_plan(load_plan("plan.yaml"))      # what `planner show plan.yaml` prints
    """
    console = console or Console()
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    for label, text in summary(plan, timeline(plan)):
        grid.add_row(label, Text(text))
    console.print(grid)
    rows, unit = stage_rows(plan)
    print_table(console, "stages", _stage_cols(plan), rows, stage_note(unit), MEM_COL)
    if plan.pp > 1:
        cuts, note = cut_rows(plan)
        cut_cols = columns(CUT_COLS, _CUT_DROP)
        print_table(console, "what crosses each split point", cut_cols, cuts, note)
    for line in over_capacity(plan):
        console.print(Text(f"over capacity: {line}", style="bold red"))
    if plan.candidates:
        note = f"{CAND_NOTE}; the chosen one in bold"
        cand_cols = columns(CAND_COLS, _CAND_DROP)
        print_table(console, "candidates", cand_cols, candidate_rows(plan), note)
    for w in plan.warnings:
        console.print(Text(f"warning: {w}", style="yellow"))
