"""The progress callback the planner's phases feed and the report draws.

Example::

    def show(phase: str, done: int, total: int, note: str = "") -> None:
        print(f"{phase}: {done}/{total} {note}")

    plan_model(model, sample, progress=show)
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["Progress"]

Progress = Callable[[str, int, int, str], None]
"""``progress(phase, done, total, note)``: called as planning advances. ``phase`` labels
one phase (a new label begins the next), ``done`` of ``total`` units (``total`` fixed for
the phase; 0 when its size is not known), ``note`` a short status ("" for none). Drawn by
:func:`planner.report.progress.progress_bar`."""
