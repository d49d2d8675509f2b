"""The candidates a plan records: every configuration tried, ranked, with why each lost.

Pure: no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from planner.cost.basis import Layout
from planner.plan.sections import Candidate
from planner.search.configurations import Config

__all__ = ["candidate", "ranked"]


def candidate(cfg: Config, step_ms: float | None, status: str, reason: str) -> Candidate:
    """The record of configuration ``cfg``: its step (None when not solved), status, reason."""
    return Candidate(
        pp=cfg.pp,
        dp=cfg.dp,
        micro_batches=cfg.m,
        schedule=cfg.schedule,
        step_ms=step_ms,
        status=status,
        reason=(f"{cfg.layout_name}: {reason}" if reason else cfg.layout_name),
    )


def ranked(tried: Sequence[Candidate], best: Layout, best_ms: float, keep: int) -> list[Candidate]:
    """The ``keep`` candidates the plan records, the solved ones fastest first.

    The chosen one is marked "chosen", the other solved ones "slower" with how
    much; room is kept for one that ran out of memory and one that was pruned,
    so the table shows why they lost; then whatever is left fills up.
    """
    solved = sorted(
        (c for c in tried if c.step_ms is not None), key=lambda c: (c.step_ms, c.pp, c.dp)
    )
    out: list[Candidate] = []
    chosen = False
    for c in solved:
        assert c.step_ms is not None
        same = (c.pp, c.dp, c.micro_batches, c.schedule) == (
            best.pp,
            best.dp,
            best.micro_batches,
            best.schedule,
        )
        if not chosen and c.step_ms == best_ms and same:
            out.append(_with(c, "chosen", f"{c.reason}: fastest predicted step"))
            chosen = True
        else:
            slower = (c.step_ms - best_ms) / best_ms
            out.append(_with(c, "slower", f"{c.reason}: {c.step_ms:.1f} ms, +{slower:.1%}"))
    others = [c for c in tried if c.step_ms is None]
    oom = [c for c in others if c.status == "out_of_memory"]
    rest = [c for c in others if c.status != "out_of_memory"]
    head = out[: max(keep - 2, 1)]
    tail = out[len(head) :] + oom[1:] + rest[1:]
    kept = (head + oom[:1] + rest[:1] + tail)[:keep]
    # Shown ranked: the solved ones fastest first, then the rest in the order kept.
    return [c for c in kept if c.step_ms is not None] + [c for c in kept if c.step_ms is None]


def _with(c: Candidate, status: str, reason: str) -> Candidate:
    return dataclasses.replace(c, status=status, reason=reason)
