"""What splitting shares: the example a split traces, and the error that names the split points."""

from __future__ import annotations

from typing import Any

from planner.plan.text import first_line

__all__ = ["Example", "StageError", "cause_line"]

Example = tuple[tuple[Any, ...], dict[str, Any]]
"""One micro-batch's ``(args, kwargs)`` of the forward."""


class StageError(ValueError):
    """The model cannot be split as the plan says; the message names the split points."""


def cause_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, and of its cause's (pipeline() wraps export's)."""
    line = first_line(exc)[:300]
    cause = exc.__cause__
    if cause is not None:
        line += f" (caused by {type(cause).__name__}: {first_line(cause)[:300]})"
    return line
