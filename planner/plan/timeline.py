"""A step as a timeline of events, and timelines as Chrome / Perfetto trace JSON.

The simulator produces :class:`Timeline` (the predicted step); the runtime
records the measured one. Both are written with :class:`ChromeTrace`, so a
predicted and a measured trace read alike: complete ("X") events named like
the schedule's actions ("F3", "B3"), ``ts`` and ``dur`` in microseconds, a
thread per stage (open in ui.perfetto.dev or chrome://tracing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ChromeTrace", "Event", "Timeline", "event_name"]

_COMPUTE = ("F", "B", "I", "W")


@dataclass(frozen=True)
class Event:
    """One interval of the timeline (milliseconds from the step's start).

    ``kind`` is "F", "B" (compute on ``stage``; a split backward: "I" for the
    input, "W" for the weights), "send_F" / "send_B" (a transfer
    on the link leaving ``stage`` forward / backward), "reduce" (DDP's gradient
    all-reduce across the replicas, at the end of the last backward) or "tail"
    (after it: the tied weights' exchange, the optimizer step).
    """

    stage: int
    kind: str
    micro_batch: int
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """The simulated step: its events and the resulting figures."""

    events: tuple[Event, ...]
    step_ms: float
    n_stages: int
    micro_batches: int
    schedule: str
    n_ranks: int = 0  # the ranks the stages run on (0: one per stage)

    def busy_ms(self, stage: int) -> float:
        """Compute time of a stage (forward + backward)."""
        return sum(e.end - e.start for e in self.events if e.stage == stage and e.kind in _COMPUTE)

    @property
    def compute_ms(self) -> float:
        """When the last forward or backward ends (the step before the all-reduce)."""
        return max((e.end for e in self.events if e.kind in _COMPUTE), default=0.0)

    @property
    def bubble_fraction(self) -> float:
        """Share of the ranks' compute phase spent idle: 1 − Σ busy / (ranks · compute_ms).

        Idle time waiting on transfers counts as bubble; the final all-reduce does not.
        """
        span = self.compute_ms
        if span <= 0:
            return 0.0
        busy = sum(self.busy_ms(s) for s in range(self.n_stages))
        return max(0.0, 1.0 - busy / ((self.n_ranks or self.n_stages) * span))


def event_name(e: Event) -> str:
    """The event's label: "F3", "B3", "send F3", "send B3", "all-reduce", "tail"."""
    if e.kind.startswith("send_"):
        return f"send {e.kind[5:]}{e.micro_batch}"
    if e.kind == "reduce":
        return "all-reduce"
    return e.kind if e.micro_batch < 0 else f"{e.kind}{e.micro_batch}"


class ChromeTrace:
    """Chrome / Perfetto trace JSON, built lane by lane.

    Example::

        trace = ChromeTrace()
        trace.thread(0, 0, "stage 0", sort_index=0)
        trace.box(0, 0, "F0", "F", 0.0, 1.5, {"stage": 0})
        json.dumps(trace.data(process_name="predicted"))
    """

    def __init__(self) -> None:
        self._meta: list[dict[str, Any]] = []
        self._boxes: list[dict[str, Any]] = []

    def _named(self, what: str, pid: int, tid: int, **args: Any) -> None:
        self._meta.append({"name": what, "ph": "M", "pid": pid, "tid": tid, "args": args})

    def process(self, pid: int, name: str, sort_index: int | None = None) -> None:
        """Name process ``pid`` (and give its place)."""
        self._named("process_name", pid, 0, name=name)
        if sort_index is not None:
            self._named("process_sort_index", pid, 0, sort_index=sort_index)

    def thread(self, pid: int, tid: int, name: str, sort_index: int) -> None:
        """Name thread ``tid`` of process ``pid`` and give its place."""
        self._named("thread_name", pid, tid, name=name)
        self._named("thread_sort_index", pid, tid, sort_index=sort_index)

    def box(
        self, pid: int, tid: int, name: str, cat: str, start_ms: float, end_ms: float, args: Any
    ) -> None:
        """One complete event from ``start_ms`` to ``end_ms``."""
        self._boxes.append(
            {
                "name": name,
                "cat": cat,
                "ph": "X",
                "pid": pid,
                "tid": tid,
                "ts": _us(start_ms),
                "dur": _us(end_ms - start_ms),
                "args": args,
            }
        )

    def instant(self, pid: int, name: str, at_ms: float, args: Any) -> None:
        """A marker across the whole process at ``at_ms`` (e.g. where the step ends)."""
        mark = {"name": name, "ph": "i", "s": "p", "pid": pid, "tid": 0, "ts": _us(at_ms)}
        self._boxes.append({**mark, "args": args})

    def data(self, **other: Any) -> dict[str, Any]:
        """The trace: names first, then the boxes; ``other`` becomes ``otherData``."""
        out: dict[str, Any] = {"traceEvents": self._meta + self._boxes, "displayTimeUnit": "ms"}
        if other:
            out["otherData"] = other
        return out


def _us(ms: float) -> float:
    return round(ms * 1e3, 3)
