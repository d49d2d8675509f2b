"""The step in closed form, and lower bounds on it: what the solver and the search price with.

:func:`closed_form` is the flow-shop formula the partition ILP minimises;
:func:`work_bound` a lower bound on any placement's step from the blocks' work
alone, with which the search prunes configurations before solving them. The
step a plan predicts is the simulation's (:mod:`planner.cost.simulate`).

Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.plan.schedule import SCHEDULES

__all__ = ["closed_form", "work_bound"]


def work_bound(total: float, heaviest: float, pp: int, micro_batches: int) -> float:
    """A lower bound on the step of any placement on ``pp`` stages with ``m`` micro-batches.

    Every micro-batch's work passes through the pipeline (``total``: Σ blocks'
    forward + backward, the loss included, on the fastest device type), and
    the busiest stage runs m micro-batches of at least an even share of it, and
    of at least the heaviest block: ``total + (m − 1) · max(total / pp, heaviest)``.

    >>> work_bound(12.0, 2.0, 4, 3)
    18.0
    """
    share = max(total / pp, heaviest)
    return total + (micro_batches - 1) * share


def closed_form(
    *,
    fwd: Sequence[float],
    bwd: Sequence[float],
    micro_batches: int,
    schedule: str = "gpipe",
    link_fwd: Sequence[float] | None = None,
    link_bwd: Sequence[float] | None = None,
    sync: Sequence[float] | None = None,
    reduce: Sequence[float] | None = None,
) -> float:
    """The step time in closed form (what the ILP minimises).

    GPipe is a flow shop for the forwards, then one for the backwards::

        T = Σ f + Σ lf + (m−1)·max(f, lf) + Σ b + Σ lb + (m−1)·max(b, lb) + max_s sync_s

    1F1B: the bottleneck stage alternates one forward and one backward::

        T = Σ (f + b) + Σ (lf + lb) + (m−1)·max(f + b, lf + lb) + max_s sync_s

    The all-reduce term assumes no overlap with other stages' drain; the
    simulation credits that overlap, so it is ≤ this bound (equal when the
    first stage has the largest all-reduce). ``reduce`` (all-reduces inside
    the last backward) adds ``Σ reduce``: the last micro-batch's gradient
    waits for each stage's in turn.
    """
    p, m = len(fwd), micro_batches
    lf = list(link_fwd) if link_fwd is not None else [0.0] * (p - 1)
    lb = list(link_bwd) if link_bwd is not None else [0.0] * (p - 1)
    sy = (max(sync) if sync else 0.0) + (sum(reduce) if reduce else 0.0)
    if schedule == "gpipe":
        t_f = sum(fwd) + sum(lf) + (m - 1) * max([*fwd, *lf])
        t_b = sum(bwd) + sum(lb) + (m - 1) * max([*bwd, *lb])
        return t_f + t_b + sy
    if schedule == "1f1b":
        work = [f + b for f, b in zip(fwd, bwd, strict=True)]
        links = [a + b for a, b in zip(lf, lb, strict=True)]
        return sum(work) + sum(links) + (m - 1) * max([*work, *links]) + sy
    raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
