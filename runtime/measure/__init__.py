"""What a running plan actually does: per-stage times, step time, peak memory, against the plan.

``recorder`` (:class:`Recorder`: timing this rank's actions and steps),
``memory`` (the stage's peak memory), ``compare`` (the predicted-vs-measured
table, the measured trace).
"""

from __future__ import annotations

from runtime.measure.compare import comparison_table, trace_json, write_trace
from runtime.measure.memory import resident_bytes
from runtime.measure.recorder import Interval, Measurement, RankRecord, Recorder

__all__ = [
    "Interval",
    "Measurement",
    "RankRecord",
    "Recorder",
    "comparison_table",
    "resident_bytes",
    "trace_json",
    "write_trace",
]
