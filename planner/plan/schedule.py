"""The pipeline schedules as data: each stage's ordered actions in one step.

An action is ``F3`` (the forward of micro-batch 3) or ``B0`` (its backward),
the compact form torch's pipelining prints. The simulator runs these lists;
the runtime maps a schedule's name to torch's class, which runs the same order.
GPipe (p = 4 stages, m = 3 micro-batches; · = idle)::

    stage 0  F0 F1 F2 ·  ·  ·  ·  ·  ·  ·  B0 B1 B2
    stage 1  ·  F0 F1 F2 ·  ·  ·  ·  B0 B1 B2
    stage 2  ·  ·  F0 F1 F2 ·  B0 B1 B2
    stage 3  ·  ·  ·  F0 F1 F2 B0 B1 B2

1F1B keeps at most p − s micro-batches in flight on stage s: ``p − s − 1``
warm-up forwards, then one forward and one backward in turn, then the
remaining backwards.
"""

from __future__ import annotations

__all__ = ["SCHEDULES", "check_schedule", "in_flight", "schedule_actions", "schedule_problem"]

SCHEDULES = ("gpipe", "1f1b")
"""The schedules the planner prices and the runtime runs."""


def schedule_problem(schedule: str, stages: int, micro_batches: int) -> tuple[str, str] | None:
    """Why ``schedule`` cannot run ``micro_batches`` through ``stages`` (why, fix), or None.

    >>> schedule_problem("1f1b", 4, 2)[0]
    '1f1b needs micro-batches ≥ stages (m 2 < pp 4)'
    """
    if schedule not in SCHEDULES:
        return (
            f"unknown schedule {schedule!r}",
            f"choose one of {', '.join(SCHEDULES)}",
        )
    if schedule == "1f1b" and micro_batches < stages:
        # torch's Schedule1F1B needs a micro-batch per stage in flight.
        return (
            f"1f1b needs micro-batches ≥ stages (m {micro_batches} < pp {stages})",
            f"--schedule gpipe, or --micro-batches {stages} or more",
        )
    return None


def check_schedule(schedule: str, stages: int, micro_batches: int) -> None:
    """Raise ``ValueError`` (why and fix) when :func:`schedule_problem` finds one."""
    problem = schedule_problem(schedule, stages, micro_batches)
    if problem is not None:
        why, fix = problem
        raise ValueError(f"{why}; fix: {fix}")


def in_flight(schedule: str, stages: int, micro_batches: int, stage: int) -> int:
    """Micro-batches whose activations ``stage`` holds at its peak.

    >>> in_flight("1f1b", 4, 8, 1), in_flight("gpipe", 4, 8, 1)
    (3, 8)
    """
    if schedule == "1f1b":
        return min(micro_batches, stages - stage)
    return micro_batches


def schedule_actions(schedule: str, n_stages: int, micro_batches: int) -> list[list[str]]:
    """Per stage, the ordered actions ("F0", "B0", ...) of one step.

    Example::

        >>> schedule_actions("1f1b", 2, 3)
        [['F0', 'F1', 'B0', 'F2', 'B1', 'B2'], ['F0', 'B0', 'F1', 'B1', 'F2', 'B2']]
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    p, m = n_stages, micro_batches
    out = []
    for s in range(p):
        if schedule == "gpipe":
            out.append([f"F{k}" for k in range(m)] + [f"B{k}" for k in range(m)])
            continue
        warm = min(p - s - 1, m)
        acts = [f"F{k}" for k in range(warm)]
        f, b = warm, 0
        while b < m:
            if f < m:
                acts.append(f"F{f}")
                f += 1
            acts.append(f"B{b}")
            b += 1
        out.append(acts)
    return out
