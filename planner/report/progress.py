"""The progress bar profiling feeds, on the terminal's stderr."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

__all__ = ["progress_bar"]

ProgressFn = Callable[[str, int, int], None]


@contextmanager
def progress_bar(*, enabled: bool = True) -> Iterator[ProgressFn | None]:
    """A rich progress bar on stderr, fed by ``profile_model``'s progress callback.

    Yields None (no bar) when disabled or when stderr is not a terminal.
    """
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    with Progress(
        TextColumn("profiling {task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        tasks: dict[str, TaskID] = {}

        def update(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(phase, total=total)
            bar.update(tasks[phase], completed=done, total=total)

        yield update
