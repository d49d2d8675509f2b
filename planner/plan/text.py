"""Short forms of messages, for error lines and tables."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

__all__ = ["ERROR_CONVENTION", "few", "first_line", "fmt_error", "fmt_ranks", "rel_error"]

ERROR_CONVENTION = "error = (predicted − measured) / measured"
"""The one sign convention of every predicted-vs-measured figure: + means the prediction
was larger (slower, bigger) than what was measured, − smaller."""


def first_line(text: object) -> str:
    """The first non-empty line of ``str(text)`` ("" when there is none).

    >>> first_line("\\n  what went wrong\\n  why\\n")
    'what went wrong'
    """
    for line in str(text).splitlines():
        if line.strip():
            return line.strip()
    return ""


def few(items: list[str], show: int = 5) -> str:
    """The first ``show`` items, comma-separated, and how many more.

    >>> few(["a", "b", "c"], 2)
    'a, b (+1 more)'
    """
    more = f" (+{len(items) - show} more)" if len(items) > show else ""
    return ", ".join(items[:show]) + more


def fmt_ranks(ranks: Sequence[int]) -> str:
    """Ranks in short: "0–7" for a run, "0,2,…,14" for a long stride, else "0,4"."""
    r = list(ranks)
    steps = {b - a for a, b in itertools.pairwise(r)}
    if len(r) >= 3 and steps == {1}:
        return f"{r[0]}–{r[-1]}"
    if len(r) > 4 and len(steps) == 1:
        return f"{r[0]},{r[1]},…,{r[-1]}"
    return ",".join(map(str, r))


def rel_error(predicted: float, measured: float) -> float:
    """(predicted − measured) / measured (:data:`ERROR_CONVENTION`); NaN when the
    measurement is missing, not positive or not a number.

    >>> rel_error(110.0, 100.0)
    0.1
    """
    if not measured > 0 or predicted != predicted:  # also NaN
        return float("nan")
    return (predicted - measured) / measured


def fmt_error(predicted: float, measured: float, digits: int = 0) -> str:
    """:func:`rel_error` in percent with its sign ("—" when there is none).

    >>> fmt_error(90.0, 100.0)
    '-10%'
    """
    e = rel_error(predicted, measured)
    return "—" if e != e else f"{e * 100:+.{digits}f}%"
