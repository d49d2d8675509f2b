"""Short forms of messages, for error lines and tables."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

__all__ = ["few", "first_line", "fmt_ranks"]


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
