"""Tables laid out to a width: words wrap whole, and columns are dropped by priority.

A column has a name, an alignment and a priority. At a given width every
kept column is at least as wide as its longest word (a number is one word),
so no word is ever split; when even that does not fit, the columns of the
highest ``drop`` go first (the rightmost of equals first) and the table says
which were hidden. Extra width goes first to the columns that need little to
be shown whole, then evenly to the rest.

Example::

    cols = [Col("stage", right=True), Col("modules", drop=2), Col("fwd ms", right=True)]
    table = fold(cols, [["0", "embed … blocks.3 (5)", "1.234"]], width=80)
    print("\\n".join(table.lines))
    table.hidden                       # [] : nothing dropped at 80 columns

Pure: no torch, no rich.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PIPE_WIDTH", "Col", "Folded", "fold", "hidden_note", "output_width", "wrap"]

PIPE_WIDTH = 100
"""The width of output to a file or pipe when ``COLUMNS`` does not say."""
_SHORT = 16
"""A wrapping column is kept at least this wide (or its natural width, if less), so a
long text does not become a column of single words."""


@dataclass(frozen=True)
class Col:
    """A column: its header, whether it is a number (right-aligned, one word per cell), and
    its ``drop`` priority (0: the last to go; higher: hidden earlier on a narrow screen)."""

    name: str
    right: bool = False
    drop: int = 0
    long: str = ""
    """What the note on hidden columns calls it, where ``name`` alone is ambiguous."""


@dataclass(frozen=True)
class Folded:
    """A table laid out: its lines, and what the layout did.

    Attributes:
        lines: the header lines, a rule, then every row's lines; none wider than the width.
        keep: the indices of the columns shown, in order; ``widths`` their widths.
        offsets: where each shown column starts on a line.
        rows: for each line, the index of the row it belongs to (None: header or rule).
        cells: for each line, each shown column's text on it (unpadded).
        hidden: the names of the columns left out.
    """

    lines: list[str]
    keep: list[int]
    widths: list[int]
    offsets: list[int]
    rows: list[int | None]
    cells: list[list[str]]
    hidden: list[str]


def output_width(isatty: bool, terminal: int | None = None) -> int:
    """The width to lay out for: the terminal's (``terminal``), else ``COLUMNS``, else
    PIPE_WIDTH (a file or pipe has no width of its own).

    >>> output_width(True, 120)
    120
    """
    if isatty and terminal:
        return terminal
    try:
        cols = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        cols = 0
    return cols if cols > 0 else PIPE_WIDTH


def wrap(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width``, broken between words only (a word longer
    than the width, which no layout here makes, is the one exception)."""
    out = textwrap.wrap(text, max(width, 1), break_long_words=False, break_on_hyphens=False)
    out = [piece for line in out for piece in _chop(line, width)]
    return out or [""]


def _chop(line: str, width: int) -> list[str]:
    if len(line) <= width or width < 1:
        return [line]
    return [line[i : i + width] for i in range(0, len(line), width)]


def _longest_word(text: str) -> int:
    return max((len(w) for w in text.split()), default=0)


def fold(
    cols: Sequence[Col],
    rows: Sequence[Sequence[str]],
    width: int,
    *,
    gap: int = 2,
    rule: bool = True,
    wrap_headers: bool = True,
) -> Folded:
    """Lay ``rows`` (one string per column) out in ``width`` characters; see the module.

    Args:
        gap: spaces between columns.
        rule: a line of "─" under the header.
        wrap_headers: a header may wrap between its words (else it is kept on one line,
            for output that a program reads column by column).
    """
    n = len(cols)
    least, natural = [], []
    for k, col in enumerate(cols):
        cells = [r[k] for r in rows]
        whole = max((len(c) for c in cells), default=0) if col.right else 0
        head = _longest_word(col.name) if wrap_headers else len(col.name)
        words = max([head] + [_longest_word(c) for c in cells])
        full = max([len(col.name)] + [len(c) for c in cells])
        least.append(max(whole, words, min(full, _SHORT), 1))
        natural.append(max(full, 1))
    keep = list(range(n))
    while len(keep) > 1 and sum(least[k] for k in keep) + gap * (len(keep) - 1) > width:
        worst = max(keep, key=lambda k: (cols[k].drop, k))
        keep.remove(worst)
    widths = _spread([least[k] for k in keep], [natural[k] for k in keep], width, gap)
    offsets = [sum(widths[:i]) + gap * i for i in range(len(keep))]
    lines: list[str] = []
    line_rows: list[int | None] = []
    line_cells: list[list[str]] = []
    header = [wrap(cols[k].name, w) for k, w in zip(keep, widths, strict=True)]
    tall = max(len(h) for h in header)
    header = [[""] * (tall - len(h)) + h for h in header]  # bottom-aligned
    for i in range(tall):
        texts = [h[i] for h in header]
        lines.append(_line(texts, [cols[k] for k in keep], widths, gap))
        line_rows.append(None)
        line_cells.append(texts)
    if rule:
        lines.append((" " * gap).join("─" * w for w in widths))
        line_rows.append(None)
        line_cells.append([""] * len(keep))
    for r, row in enumerate(rows):
        pieces = [wrap(row[k], w) for k, w in zip(keep, widths, strict=True)]
        for i in range(max(len(p) for p in pieces)):
            texts = [p[i] if i < len(p) else "" for p in pieces]
            lines.append(_line(texts, [cols[k] for k in keep], widths, gap))
            line_rows.append(r)
            line_cells.append(texts)
    hidden = [cols[k].long or cols[k].name for k in range(n) if k not in keep]
    return Folded(lines, keep, widths, offsets, line_rows, line_cells, hidden)


def _line(texts: list[str], cols: list[Col], widths: list[int], gap: int) -> str:
    cells = [
        t.rjust(w) if c.right else t.ljust(w) for t, c, w in zip(texts, cols, widths, strict=True)
    ]
    return (" " * gap).join(cells).rstrip()


def _spread(least: list[int], natural: list[int], width: int, gap: int) -> list[int]:
    """Widths from ``least`` toward ``natural`` within ``width``: the columns that need
    the least extra are made whole first, the rest share what remains evenly."""
    widths = list(least)
    spare = width - sum(widths) - gap * (len(widths) - 1)
    short = sorted((n - w, k) for k, (w, n) in enumerate(zip(least, natural, strict=True)) if n > w)
    while short and spare > 0:
        fair = spare // len(short)
        need, k = short[0]
        if need <= fair or fair == 0:
            give = min(need, spare) if need <= fair else 1
            widths[k] += give
            spare -= give
            short = sorted((natural[j] - widths[j], j) for _, j in short if natural[j] > widths[j])
            continue
        for _, j in short:
            widths[j] += fair
        spare -= fair * len(short)
        short = sorted((natural[j] - widths[j], j) for _, j in short if natural[j] > widths[j])
    return widths


def hidden_note(hidden: Sequence[str], width: int, where: str = "the HTML report") -> str:
    """The line that says which columns a narrow table left out ("" when none)."""
    if not hidden:
        return ""
    names = ", ".join(hidden)
    many = f"{len(hidden)} column{'s' if len(hidden) > 1 else ''}"
    return f"({many} hidden at {width} columns: {names}; widen the terminal or see {where})"
