"""What planning is doing, on stderr: a labelled bar per phase on a terminal, one line at
each phase's start and end in a file or pipe.

Everything that takes time reports through one callback (``Progress``, defined in
:mod:`planner.profile.timing`)::

    progress(phase, done, total, note)

* ``phase``: a label, the same for the whole phase ("profiling 37 blocks at
  micro-batch 8 (1 of 2)"); a call with a new label begins a new phase and ends
  the one before;
* ``done`` of ``total`` units: ``total`` is fixed for the phase (0: its size is not
  known, as while tracing); ``done == total > 0`` ends the phase;
* ``note``: a short status shown beside the bar and in the closing line ("round 3",
  "best pp 2 × dp 4: 12.3 ms"), "" for none.

Pure: no torch (rich is imported when a bar is drawn).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from planner.plan.progress import Progress

__all__ = ["PREFIX", "PhaseLines", "progress_bar"]

PREFIX = "[planner]"
"""What starts every progress line written to a file or pipe."""


class PhaseLines:
    """A ``Progress`` callback that writes a line when a phase begins and one when it
    ends (with its duration and last note) to ``stream``; nothing in between.

    Example::

        lines = PhaseLines(sys.stderr)
        lines("searching 88 configurations", 0, 88, "")   # [planner] searching 88 ... ...
        lines("searching 88 configurations", 88, 88, "best pp 2 × dp 4: 12.3 ms")
        # [planner] searching 88 configurations: 4.1 s, best pp 2 × dp 4: 12.3 ms
    """

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.phase: str | None = None
        self.note = ""
        self.started = 0.0

    def __call__(self, phase: str, done: int, total: int, note: str = "") -> None:
        if phase != self.phase:
            self.close()
            self.phase, self.started = phase, time.perf_counter()
            self._write(f"{phase} ...")
        self.note = note or self.note
        if total > 0 and done >= total:
            self.close()

    def close(self) -> None:
        """End the current phase, if one is open (its closing line)."""
        if self.phase is None:
            return
        took = f"{self.phase}: {time.perf_counter() - self.started:.1f} s"
        self._write(f"{took}, {self.note}" if self.note else took)
        self.phase, self.note = None, ""

    def _write(self, text: str) -> None:
        print(f"{PREFIX} {text}", file=self.stream, flush=True)


class _Bars:
    """A ``Progress`` callback drawing one rich bar per phase; a finished phase's bar
    stays, full, with its time."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar
        self.task: Any = None
        self.phase: str | None = None

    def __call__(self, phase: str, done: int, total: int, note: str = "") -> None:
        if phase != self.phase:
            self.close()
            self.phase = phase
            self.task = self.bar.add_task(phase, total=total or None, line=phase)
        line = f"{phase}  {note}" if note else phase
        self.bar.update(self.task, completed=min(done, total) if total else 0, line=line)
        if total > 0 and done >= total:
            self.close()

    def close(self) -> None:
        if self.phase is None:
            return
        t = self.bar.tasks[self.task]
        if t.total is None:  # a phase of unknown size: shown done
            self.bar.update(self.task, total=1, completed=1)
        else:
            self.bar.update(self.task, completed=t.total)
        self.bar.stop_task(self.task)
        self.phase = None


@contextmanager
def progress_bar(
    *, enabled: bool = True, stream: IO[str] | None = None
) -> Iterator[Progress | None]:
    """A ``Progress`` callback for planning's phases, on ``stream`` (default stderr).

    On a terminal: a labelled rich bar per phase (its share done, elapsed time and
    note). In a file or pipe: ``PhaseLines`` (one line per phase's start and end, never
    a bar). Yields None when not ``enabled``. Stdout is never written.

    Example::

        with progress_bar() as progress:
            plan = plan_model(model, sample, cluster=cluster, progress=progress)
    """
    out = stream or sys.stderr
    if not enabled:
        yield None
        return
    if not out.isatty():
        lines = PhaseLines(out)
        try:
            yield lines
        finally:
            lines.close()
        return
    from rich import progress as rp
    from rich.console import Console
    from rich.table import Column

    console = Console(file=out)
    # The fixed-width parts first; the label and note last, cut at the screen's edge.
    label = Column(no_wrap=True, overflow="ellipsis", max_width=max(console.width - 36, 20))
    with rp.Progress(
        rp.TimeElapsedColumn(),
        rp.BarColumn(bar_width=20),
        rp.TaskProgressColumn(),
        rp.TextColumn("{task.fields[line]}", markup=False, table_column=label),
        console=console,
    ) as bar:
        bars = _Bars(bar)
        try:
            yield bars
        finally:
            bars.close()
