"""Checkpoints of a running plan with ``torch.distributed.checkpoint`` (DCP).

``store`` (the folder layout, the completion marker, :func:`save`,
:func:`latest_complete`), ``resume`` (:func:`load`, the seeds of an exact
resume), ``safeload`` (reading DCP's files with nothing unpickled that could
run code).
"""

from __future__ import annotations

from runtime.checkpoint.resume import load, seed_step, step_seed
from runtime.checkpoint.safeload import METADATA
from runtime.checkpoint.store import (
    COMPLETE,
    FORMAT,
    checkpoint_path,
    incomplete_reason,
    latest_complete,
    read_marker,
    save,
)

__all__ = [
    "COMPLETE",
    "FORMAT",
    "METADATA",
    "checkpoint_path",
    "incomplete_reason",
    "latest_complete",
    "load",
    "read_marker",
    "save",
    "seed_step",
    "step_seed",
]
