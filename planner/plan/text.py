"""Short forms of messages, for error lines and tables."""

from __future__ import annotations

__all__ = ["few", "first_line"]


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
