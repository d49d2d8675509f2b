"""What a run measured, as data: every rank's timed actions and peak memory.

The runtime's recorder (``runtime.measure.recorder``) fills these records while
a plan trains; ``planner run --measurements FILE`` saves them (JSON), and the
planner reads them back to fit a calibration (``planner.calibrate``). They are
part of the contract between the two sides, so they live here.

Times in the records are seconds since the recorder started (aligned across
ranks by a barrier); the figures they give are milliseconds.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from planner.plan.codec import Record
from planner.plan.files import atomic_write

__all__ = [
    "Interval",
    "Measurement",
    "RankRecord",
    "joined",
    "load_measurement",
    "save_measurement",
]

_FORMAT = 1


@dataclass(frozen=True)
class Interval(Record):
    """One timed action: ``kind`` "F", "B", "W" (a split backward's weights' part), "loss",
    "tied", "optimizer" or "step".

    ``start`` and ``end`` are seconds since the recorder started (aligned
    across ranks); ``micro_batch`` is -1 for whole-step actions. ``stage``:
    the stage an "F", "B" or "loss" ran for on a rank running several stages
    (v > 1); -1 otherwise (the record's ``stage``).
    """

    kind: str
    step: int
    micro_batch: int
    start: float
    end: float
    stage: int = -1

    @property
    def ms(self) -> float:
        return (self.end - self.start) * 1e3


@dataclass(frozen=True, kw_only=True)
class RankRecord(Record):
    """One rank's record, as gathered to rank 0."""

    rank: int
    replica: int
    stage: int
    device: str
    intervals: tuple[Interval, ...] = ()
    peak_bytes: float = 0.0
    memory_method: str = ""

    def durations(
        self, kind: str, steps: set[int], skip_mb: int | None = None, stage: int | None = None
    ) -> list[float]:
        """Milliseconds of every ``kind`` action in ``steps``; a forward includes its loss,
        a backward its weights' part where the schedule splits it (``W``).

        ``skip_mb``: leave out this micro-batch's actions (see ``stage_figures``).
        ``stage``: only this stage's actions (a rank running several stages).
        """
        out: dict[tuple[int, int], float] = {}
        for iv in self.intervals:
            if iv.step not in steps or (skip_mb is not None and iv.micro_batch == skip_mb):
                continue
            if stage is not None and (iv.stage if iv.stage >= 0 else self.stage) != stage:
                continue
            if iv.kind == kind or (iv.kind, kind) in (("loss", "F"), ("W", "B")):
                key = (iv.step, iv.micro_batch)
                out[key] = out.get(key, 0.0) + iv.ms
        return list(out.values())


@dataclass(frozen=True, kw_only=True)
class Measurement(Record):
    """Every rank's record and which steps count (the ones after warm-up).

    ``counted``: the steps the times come from. ``memory_steps``: the steps the peak
    memory comes from; on the CPU they are tracked tensor by tensor, which slows
    them, so they are not in ``counted`` unless the run had no other steps.
    """

    records: tuple[RankRecord, ...]
    steps: tuple[int, ...]  # recorded steps, in order
    counted: tuple[int, ...]  # the times' source
    global_batch: int
    memory_steps: tuple[int, ...] = ()  # the peak memory's source

    def stage_figures(
        self, stage: int, *, skip_last_backward: int | None = None
    ) -> dict[str, float]:
        """Medians over the counted steps (and over replicas) for one stage.

        ``skip_last_backward=m``: leave micro-batch m − 1's backward out (with
        dp > 1 it holds DDP's gradient all-reduce; see ``comparison_table``).
        On a rank running several stages (v > 1) the step and the peak memory
        are the rank's, shared by its stages.
        """
        counted = set(self.counted)
        recs = [
            r
            for r in self.records
            if r.stage == stage or any(iv.stage == stage for iv in r.intervals)
        ]
        skip = None if skip_last_backward is None else skip_last_backward - 1
        fwd = [d for r in recs for d in r.durations("F", counted, stage=stage)]
        bwd = [d for r in recs for d in r.durations("B", counted, skip, stage=stage)]
        step = [d for r in recs for d in r.durations("step", counted)]
        return {
            "fwd_ms": median(fwd),
            "bwd_ms": median(bwd),
            "step_ms": median(step),
            "peak_bytes": max((r.peak_bytes for r in recs), default=float("nan")),
        }

    @property
    def step_ms(self) -> float:
        """Median over counted steps of the slowest rank's step time."""
        counted = set(self.counted)
        per_step: dict[int, float] = {}
        for r in self.records:
            for iv in r.intervals:
                if iv.kind == "step" and iv.step in counted:
                    per_step[iv.step] = max(per_step.get(iv.step, 0.0), iv.ms)
        return median(list(per_step.values()))

    @property
    def samples_per_s(self) -> float:
        ms = self.step_ms
        return self.global_batch / (ms / 1e3) if ms > 0 else float("nan")


def joined(runs: Sequence[Measurement]) -> Measurement:
    """Several runs of one plan as one: each run's steps and clock moved past the one
    before's, so that medians are over every run's counted steps and no interval of one
    run meets another's.

    Raises:
        ValueError: the runs are of different ranks or batches.
    """
    if not runs:
        raise ValueError("no runs to join")
    first = runs[0]
    shape = [(r.rank, r.replica, r.stage) for r in first.records]
    step_gap = 1 + max((s for run in runs for s in run.steps), default=0)
    time_gap = 1.0 + max(
        (iv.end for run in runs for r in run.records for iv in r.intervals), default=0.0
    )
    records: dict[int, list[Interval]] = {r.rank: [] for r in first.records}
    steps: list[int] = []
    counted: list[int] = []
    memory_steps: list[int] = []
    for k, run in enumerate(runs):
        if [(r.rank, r.replica, r.stage) for r in run.records] != shape or (
            run.global_batch != first.global_batch
        ):
            raise ValueError(f"run {k + 1} is not of the same plan as run 1 (ranks or batch)")
        for r in run.records:
            records[r.rank] += [
                Interval(
                    iv.kind,
                    iv.step + k * step_gap,
                    iv.micro_batch,
                    iv.start + k * time_gap,
                    iv.end + k * time_gap,
                    iv.stage,
                )
                for iv in r.intervals
            ]
        steps += [s + k * step_gap for s in run.steps]
        counted += [s + k * step_gap for s in run.counted]
        memory_steps += [s + k * step_gap for s in run.memory_steps]
    return Measurement(
        records=tuple(
            replace(r, intervals=tuple(records[r.rank]), peak_bytes=_peak(runs, r.rank))
            for r in first.records
        ),
        steps=tuple(steps),
        counted=tuple(counted),
        global_batch=first.global_batch,
        memory_steps=tuple(memory_steps),
    )


def _peak(runs: Sequence[Measurement], rank: int) -> float:
    got = [x.peak_bytes for run in runs for x in run.records if x.rank == rank]
    return max((x for x in got if x == x), default=float("nan"))


def median(xs: list[float]) -> float:
    """The median, NaN for no values."""
    return statistics.median(xs) if xs else float("nan")


def save_measurement(result: Measurement, path: str | os.PathLike[str]) -> Path:
    """Write ``result`` as JSON, atomically."""
    data = {"format": _FORMAT, "measurement": result.to_dict()}
    return atomic_write(path, json.dumps(data))


def load_measurement(path: str | os.PathLike[str]) -> Measurement:
    """Read a file :func:`save_measurement` wrote.

    Raises:
        ValueError: it is not one (the message names the file and the key).
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the measurements {path}: {exc}") from exc
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        raise ValueError(f"{path} is not a measurements file of format {_FORMAT}")
    return Measurement.from_dict(data.get("measurement"), path=str(path))
