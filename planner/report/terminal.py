"""The plan report on the terminal: a summary, the stage, split-point and candidate
tables, warnings."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

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

__all__ = ["print_plan"]

_RICH_STYLE = {"over": "bold red", "near": "yellow", "chosen": "bold green"}


def _rich_table(
    title: str, cols: list[str], rows: list[Row], note: str, mem: int | None = None
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
    """Print the plan's summary, stage table, split points, candidates and warnings.

    Example::

        print_plan(load_plan("plan.yaml"))      # what `planner show plan.yaml` prints
    """
    console = console or Console()
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    for label, text in summary(plan, timeline(plan)):
        grid.add_row(label, Text(text))
    console.print(grid)
    rows, unit = stage_rows(plan)
    console.print(_rich_table("stages", STAGE_COLS, rows, stage_note(unit), MEM_COL))
    if plan.pp > 1:
        cuts, note = cut_rows(plan)
        console.print(_rich_table("what crosses each split point", CUT_COLS, cuts, note))
    for line in over_capacity(plan):
        console.print(Text(f"over capacity: {line}", style="bold red"))
    if plan.candidates:
        note = f"{CAND_NOTE}; the chosen one in bold"
        console.print(_rich_table("candidates", CAND_COLS, candidate_rows(plan), note))
    for w in plan.warnings:
        console.print(Text(f"warning: {w}", style="yellow"))
