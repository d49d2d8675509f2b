"""The schedules and stages per rank the search tries for one (pp, dp, m).

One-stage schedules (``SCHEDULES``: GPipe, 1F1B) at v = 1; the multi-stage ones
(``MULTI_STAGE``: Interleaved 1F1B, Looped BFS, Interleaved ZB) at v = 2 …
``max_virtual`` (1 by default: off unless asked), or at the pinned
``--virtual-stages``; where they are tried, Interleaved ZB also at v = 1 (ZB-1p),
and ZB-V and DualPipeV (two stages per rank) at v = 2 only; always with pp · v
stages no more than the model's blocks can make.

Pure: no torch.
"""

from __future__ import annotations

from planner.options import SearchOptions
from planner.plan.schedule import MULTI_STAGE, SCHEDULES, V_SHAPED, schedule_problem

__all__ = ["Rejection", "schedules"]

Rejection = tuple[str, str]
"""(why, fix): a configuration refused, in the words the error shows."""


def schedules(
    pp: int, dp: int, m: int, options: SearchOptions, rejected: list[Rejection], max_stages: int
) -> list[tuple[int, int, int, str, int]]:
    """The (pp, dp, m, schedule, v) of one (pp, dp, m): each schedule, at each v it runs
    (those refused go to ``rejected`` with why and the fix)."""
    out = []
    names = [options.schedule] if options.schedule else [*SCHEDULES, *MULTI_STAGE]
    for sched in names:
        if pp == 1 and sched == "1f1b":
            continue  # one stage: both schedules are the same
        for v in _virtuals(sched, pp, options, max_stages, rejected):
            problem = schedule_problem(sched, pp, m, v)
            if problem is not None:
                rejected.append(problem)
                continue
            out.append((pp, dp, m, sched, v))
    return out


def _virtuals(
    sched: str, pp: int, options: SearchOptions, max_stages: int, rejected: list[Rejection]
) -> list[int]:
    """The stages per rank tried for ``sched`` at ``pp`` (1 for one-stage schedules)."""
    if sched not in MULTI_STAGE:
        if options.virtual not in (None, 1):
            rejected.append(
                (
                    f"{sched} runs one stage per rank (--virtual-stages {options.virtual})",
                    f"--schedule {MULTI_STAGE[0]} or {MULTI_STAGE[1]}, or --virtual-stages 1",
                )
            )
            return []
        return [1]
    if pp == 1:
        rejected.append(
            (
                f"{sched} with pp 1: one process runs every stage, with transfers and no gain",
                "--pp 2 or more, or --schedule gpipe",
            )
        )
        return []
    top = max(1, max_stages // pp)
    top_v = max(options.max_virtual, 2 if options.schedule == sched else 1)  # pinned: v ≥ 2
    wanted = [options.virtual] if options.virtual else list(range(2, top_v + 1))
    if sched in V_SHAPED and not options.virtual:
        wanted = wanted[:1]  # exactly two stages per rank
    if sched == "interleaved-zb" and wanted and not options.virtual:
        wanted = [1, *wanted]  # v 1: the zero-bubble paper's ZB-1p
    out = [v for v in wanted if v <= top]
    for v in wanted:
        if v > top:
            rejected.append(
                (
                    f"pp {pp} × v {v} = {pp * v} stages > {max_stages}: the model has "
                    f"{max_stages} block(s) that can start a stage",
                    f"--virtual-stages {top} or fewer, or a smaller --pp",
                )
            )
            break
    return out
