"""The step in closed form, and lower bounds on it: what the solver and the search price with.

:func:`closed_form` is the flow-shop formula the partition ILP minimises;
:func:`work_bound` a lower bound on any placement's step from the blocks' work
alone, with which the search prunes configurations before solving them. The
step a plan predicts is the simulation's (:mod:`planner.cost.simulate`).

Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from planner.cost.stage_time import CPU_CORUN_SLOWDOWN
from planner.plan.schedule import SCHEDULES, SPLIT_BACKWARD

__all__ = [
    "allreduce_floor",
    "closed_form",
    "reduce_chain_bound",
    "shared_cores_bound",
    "work_bound",
]


def work_bound(
    total: float,
    heaviest: float,
    pp: int,
    micro_batches: int,
    schedule: str = "gpipe",
    virtual: int = 1,
) -> float:
    """A lower bound on the step of any placement on ``pp`` stages with ``m`` micro-batches.

    ``total``: Σ blocks' forward + backward, the loss included, on the fastest
    device type; the busiest stage holds at least an even share of it, and at
    least the heaviest block: ``share = max(total / pp, heaviest)``. Paths of
    the step's graph ([Note: the step graph]) give:

    * GPipe: the first micro-batch's forwards up to the busiest stage, its m
      forwards and backwards, and every other stage once: ``total + (m − 1)·share``;
    * 1F1B: the busiest stage runs 2m actions one after another, and micro-batch
      0 goes through every stage and back: ``max(m·share, total)``. (The GPipe
      bound does not hold: stage 0 of two, 10 + 10 ms per micro-batch against
      1 + 1, runs 1F1B with m = 2 in 40 ms, below 22 + 20.)

    * several stages per rank (``virtual`` > 1: Interleaved 1F1B, Looped BFS):
      the busiest rank runs its stages' 2m actions each, at least an even
      share of the work, one after another, and micro-batch 0 goes through
      every stage and back: ``max(m·share, total)``.

    * a split backward (the zero-bubble schedules): micro-batch 0's round trip
      runs the input's part of each backward only, and the weights' parts later,
      so only the busiest rank's work is a path: ``m·share``.

    Every action runs at most at its speed alone, so the bound holds where
    stages share cores too.

    >>> work_bound(12.0, 2.0, 4, 3), work_bound(12.0, 2.0, 4, 4, "1f1b")
    (18.0, 12.0)
    """
    share = max(total / pp, heaviest)
    if schedule in SPLIT_BACKWARD:
        return micro_batches * share
    if schedule == "1f1b" or virtual > 1:
        return max(micro_batches * share, total)
    return total + (micro_batches - 1) * share


def reduce_chain_bound(total: float, last: float, micro_batches: int, reduces: float) -> float:
    """A lower bound on the step from the chain of the last backwards' all-reduces.

    A path of the step's graph ([Note: the step graph]) that every placement
    has: micro-batch 0's forwards reach the last stage, which runs its m
    forwards and m backwards; its last backward all-reduces (DDP, inside the
    backward) before its gradient goes back, and so on down to stage 0, whose
    tail ends the step. So every stage's forward, backward and all-reduce lie
    on it, and the last stage's work m times::

        T ≥ Σ_s (f_s + b_s) + (m − 1)·(f + b)_{S−1} + Σ_s reduce_s
          ≥ total + (m − 1)·last + reduces

    ``total``: Σ blocks' forward + backward, loss included, on the fastest
    device type; ``last``: the last block's, loss included (the last stage
    holds it); ``reduces``: a lower bound on Σ_s reduce_s
    (:func:`allreduce_floor`). Every figure is at most the step's own, links and
    tails left out, so it is a lower bound.

    >>> reduce_chain_bound(12.0, 2.0, 4, 30.0)
    48.0
    """
    return total + (micro_batches - 1) * last + reduces


def allreduce_floor(
    ring_time: Callable[[Sequence[int], float], float],
    grid: Sequence[Sequence[int]],
    wire_bytes: float,
    free: int = 0,
) -> float:
    """A lower bound (ms) on Σ_s of the stages' gradient all-reduces, however the
    blocks are placed: ``grid[s]`` the ranks of stage s, ``wire_bytes`` what all
    the model's gradients put on the wire, ``ring_time(ranks, nbytes)`` a ring
    all-reduce's seconds (``Cluster.allreduce_time``), ``free`` the model's blocks
    that hold no parameter.

    A ring's time is affine in its bytes (t = α + β·S, α, β ≥ 0), and the stages'
    bytes add up to at least ``wire_bytes`` (tied copies only add), so

        Σ_s t_s ≥ Σ_s α_s + min_s β_s · wire_bytes = Σ_s α_s + min_s (t_s(wire_bytes) − α_s)

    over the stages that hold a parameter: a stage that holds none all-reduces
    nothing (``StageTime.reduce_ms``), and at most ``free`` stages can (each
    needs a block of its own), so the α of the ``free`` costliest are left out,
    never all (0 when no stage has more than one replica, or no parameter).
    """
    if not grid or wire_bytes <= 0:
        return 0.0
    alphas = [ring_time(ranks, 0.0) for ranks in grid]
    bytes_part = min(ring_time(r, wire_bytes) - a for r, a in zip(grid, alphas, strict=True))
    held = len(alphas) - min(free, len(alphas) - 1)  # stages that must hold a parameter
    # rounding of the sums aside (1e-9 relative: a bound, not a figure to print)
    return (sum(sorted(alphas)[:held]) + max(bytes_part, 0.0)) * 1e3 * (1 - 1e-9)


def shared_cores_bound(
    total: float,
    pp: int,
    dp: int,
    micro_batches: int,
    threads: int,
    cores: int,
    corun: float = CPU_CORUN_SLOWDOWN,
) -> float:
    """A lower bound on the step of pp · dp local CPU processes sharing ``cores`` cores.

    ``total``: one micro-batch's Σ forward + backward (loss included) on one
    process of ``threads`` threads running alone; a step does dp · m of them. In
    [Note: shared cores] (:func:`planner.cost.stage_time.cpu_speeds`) k busy
    processes each run at min(1, cores / (k · threads)) of their speed alone, and
    ``corun`` (c, default ``CPU_CORUN_SLOWDOWN``) slower still while more than one is on a core, so
    together they get through at most

        r = max(min(1, cores / threads), min(pp · dp, cores / threads) / c)

    processes' worth of work per unit of time, and step ≥ dp · m · total / r.

    >>> round(shared_cores_bound(10.0, pp=4, dp=2, micro_batches=4, threads=1, cores=2), 1)
    46.0
    """
    lanes = cores / threads
    rate = max(min(1.0, lanes), min(pp * dp, lanes) / corun)
    return dp * micro_batches * total / rate


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
