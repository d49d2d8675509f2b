"""Step (b) of bench/gpu_check.sh, on paper: the analytic profile beside the measured one.

Pure numbers and text (no torch): :mod:`bench._gpu_measure` times the blocks and hands
over its rounds and saved bytes; here they become medians, the block-by-block table,
the totals, and the two files (``profile-measured.json`` and the comparison that the
summary, :mod:`bench._gpu_summary`, reads).
"""

from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path
from typing import Any, TypedDict

from planner.plan.records import ModelProfile
from planner.plan.text import ERROR_CONVENTION, fmt_error, rel_error

__all__ = [
    "MERGED_NOTE",
    "Round",
    "cells",
    "compare_record",
    "comparison_lines",
    "measured_record",
    "median",
    "report",
    "total_lines",
    "totals",
]

MIB = 2**20
MERGED_NOTE = "merged: no input of the block needs a gradient; its backward is in the row above"


class Round(TypedDict):
    """One forward + loss + backward, in ms: per block (NaN: no backward mark, "merged"
    into the block before), the loss's two halves, and the whole round."""

    fwd: list[float]
    bwd: list[float]
    loss_fwd: float
    loss_bwd: float
    whole: float


def median(xs: list[float]) -> float:
    """The median of the figures that are numbers; NaN when none is.

    >>> median([3.0, float("nan"), 1.0])
    2.0
    """
    numbers = [x for x in xs if x == x]
    return statistics.median(numbers) if numbers else math.nan


def measured_record(
    an: ModelProfile,
    *,
    where: str,
    how: str,
    micro_batch: int,
    rounds: list[Round],
    saved: list[int],
) -> dict[str, Any]:
    """``profile-measured.json``: the medians over ``rounds``, per block of ``an``."""
    n = len(an.blocks)
    fwd = [median([r["fwd"][k] for r in rounds]) for k in range(n)]
    bwd = [median([r["bwd"][k] for r in rounds]) for k in range(n)]
    return {
        "measured_on": where,
        "how": how,
        "micro_batch": micro_batch,
        "rounds": len(rounds),
        "blocks": [
            {
                "index": b.index,
                "name": b.name,
                "fwd_ms": fwd[k],
                "bwd_ms": bwd[k],
                "activation_bytes": saved[k],
            }
            for k, b in enumerate(an.blocks)
        ],
        "loss_fwd_ms": median([r["loss_fwd"] for r in rounds]),
        "loss_bwd_ms": median([r["loss_bwd"] for r in rounds]),
        "whole_ms": median([r["whole"] for r in rounds]),
    }


def cells(p: float, m: float, digits: int) -> str:
    """Predicted, measured ("merged" when it is NaN) and the error, in three columns.

    >>> cells(0.5, 0.4, 3)
    '    0.500     0.400   +25%'
    """
    shown = f"{m:>9.{digits}f}" if m == m else f"{'merged':>9}"
    return f"{p:>9.{digits}f} {shown} {fmt_error(p, m):>6}"


def comparison_lines(an: ModelProfile, measured: dict[str, Any]) -> list[str]:
    """The block-by-block table: forward, backward and saved activations, with errors."""
    blocks = measured["blocks"]
    lines = [
        f"\nanalytic ({an.device}) against measured on {measured['measured_on']} "
        f"({measured['how']}, median of {measured['rounds']} rounds); {ERROR_CONVENTION}",
        f"{'#':>3}  {'block':<24} {'fwd ms':>9} {'meas':>9} {'err':>6}  {'bwd ms':>9} "
        f"{'meas':>9} {'err':>6}  {'act MiB':>9} {'meas':>9} {'err':>6}",
    ]
    for b, got in zip(an.blocks, blocks, strict=True):
        lines.append(
            f"{b.index:>3}  {(b.name or '<input>')[:24]:<24} {cells(b.fwd_ms, got['fwd_ms'], 3)}  "
            f"{cells(b.bwd_ms, got['bwd_ms'], 3)}  "
            f"{cells(b.activation_bytes / MIB, got['activation_bytes'] / MIB, 2)}"
        )
    lines.append(
        f"{'':>3}  {'(loss)':<24} {cells(an.loss_fwd_ms, measured['loss_fwd_ms'], 3)}  "
        f"{cells(an.loss_bwd_ms, measured['loss_bwd_ms'], 3)}"
    )
    if any(got["bwd_ms"] != got["bwd_ms"] for got in blocks):
        lines.append(MERGED_NOTE)
    return lines


def totals(
    an: ModelProfile, rounds: list[Round], saved: list[int]
) -> dict[str, tuple[float, float]]:
    """(predicted, measured) sums; measured: the median over rounds of each round's sum,
    "merged" spans included (they are in the block before)."""
    an_fwd = sum(b.fwd_ms for b in an.blocks) + an.loss_fwd_ms
    an_bwd = sum(b.bwd_ms for b in an.blocks) + an.loss_bwd_ms
    return {
        "fwd_ms": (an_fwd, median([sum(r["fwd"]) + r["loss_fwd"] for r in rounds])),
        "bwd_ms": (
            an_bwd,
            median([sum(x for x in r["bwd"] if x == x) + r["loss_bwd"] for r in rounds]),
        ),
        "fwd_bwd_ms": (an_fwd + an_bwd, median([r["whole"] for r in rounds])),
        "activation_mib": (sum(b.activation_bytes for b in an.blocks) / MIB, sum(saved) / MIB),
    }


def total_lines(sums: dict[str, tuple[float, float]]) -> list[str]:
    return [
        f"total {key:<16} predicted {p:10.3f}  measured {m:10.3f}  error {fmt_error(p, m)}"
        for key, (p, m) in sums.items()
    ]


def compare_record(
    an: ModelProfile, measured: dict[str, Any], sums: dict[str, tuple[float, float]]
) -> dict[str, Any]:
    """The comparison the summary reads: what was compared, and each total's error."""
    return {
        "analytic_device": an.device,
        "measured_on": measured["measured_on"],
        "how": measured["how"],
        "micro_batch": an.batch_size,
        "blocks": len(an.blocks),
        "rounds": measured["rounds"],
        "totals": {
            key: {"predicted": p, "measured": m, "error": rel_error(p, m)}
            for key, (p, m) in sums.items()
        },
    }


def report(
    an: ModelProfile,
    measured: dict[str, Any],
    sums: dict[str, tuple[float, float]],
    *,
    out_path: str | Path,
    compare_path: str | Path,
) -> None:
    """Write ``profile-measured.json``, print the analytic profile and the comparison,
    then write the comparison's record for the summary."""
    from rich.console import Console

    from planner.report.profile_table import print_profile

    Path(out_path).write_text(json.dumps(measured, indent=1))
    console = Console(width=int(os.environ.get("COLUMNS", "160")))
    print_profile(an, title=f"analytic for {an.device}", console=console)
    for line in (*comparison_lines(an, measured), *total_lines(sums)):
        print(line)
    Path(compare_path).write_text(json.dumps(compare_record(an, measured, sums), indent=1))
