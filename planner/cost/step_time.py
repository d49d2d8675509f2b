"""The step in closed form, and lower bounds on it: what the solver and the search price with.

:func:`closed_form` is the flow-shop formula the partition ILP minimises;
:func:`work_bound` a lower bound on any placement's step from the blocks' work
alone, with which the search prunes configurations before solving them. The
step a plan predicts is the simulation's (:mod:`planner.cost.simulate`).

Pure: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

from planner.cost.stage_time import CPU_CORUN_SLOWDOWN
from planner.plan.schedule import SCHEDULES, SPLIT_BACKWARD

__all__ = [
    "SegmentBound",
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
) -> float:
    """A lower bound (ms) on Σ_s of the stages' gradient all-reduces, however the
    blocks are placed: ``grid[s]`` the ranks of stage s, ``wire_bytes`` what all
    the model's gradients put on the wire, ``ring_time(ranks, nbytes)`` a ring
    all-reduce's seconds (``Cluster.allreduce_time``).

    A ring's time is affine in its bytes (t = α + β·S, α, β ≥ 0), and the stages'
    bytes add up to at least ``wire_bytes`` (tied copies only add), so

        Σ_s t_s ≥ Σ_s α_s + min_s β_s · wire_bytes = Σ_s α_s + min_s (t_s(wire_bytes) − α_s)

    (0 when no stage has more than one replica).
    """
    if not grid:
        return 0.0
    alphas = [ring_time(ranks, 0.0) for ranks in grid]
    bytes_part = min(ring_time(r, wire_bytes) - a for r, a in zip(grid, alphas, strict=True))
    # rounding of the sums aside (1e-9 relative: a bound, not a figure to print)
    return (sum(alphas) + max(bytes_part, 0.0)) * 1e3 * (1 - 1e-9)


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


class SegmentBound:
    """Lower bounds on the step of any placement in which stage s holds blocks [i, j).

    From paths of the step's graph ([Note: the step graph]) that every
    placement has, with the other stages at their least (dynamic programs over
    the placements of the blocks before and after the segment):

    * micro-batch 0's forwards reach stage s, stage s runs its m forwards and
      m backwards, its all-reduce and tail: ``Pf + m·(f + b) + reduce + tail``;
    * … then the last micro-batch's backwards (each with its stage's all-reduce)
      go back to stage 0, whose tail ends the step: ``Pre + m·(f + b) + reduce``
      (+ its tail when s = 0);
    * the wait for stage s's first backward: a forward runs through the later
      stages and micro-batch 0's backward comes back (``link + Suf``). GPipe: after
      stage s's m forwards (``+ link + Suf``); 1F1B: stage s runs
      w = min(S − s, m) forwards before its first backward and the rest after
      it, so only the wait beyond the w − 1 forwards that overlap it,
      ``max(0, link + Suf − (w − 1)·f)``. Both paths above hold it.

    [Note: 1F1B's two round trips] Stage s of 1F1B runs w = min(S − s, m)
    forwards, its first backward, then alternates (F, B) and ends with w
    backwards. Its first backward waits for micro-batch 0's round trip through
    the later stages (``link + Suf``), which overlaps its w − 1 other warm-up
    forwards; its last backward waits for the last micro-batch's round trip,
    in which every later stage's backward is its last and all-reduces
    (``link + Suf_red``), which overlaps its w − 1 other cool-down backwards.
    With w < m the path through both costs ``m·(f + b) + reduce +
    max(0, trip − (w − 1)·f) + max(0, trip_red − (w − 1)·b)``; with w = m
    (every forward first) the second trip starts at the last forward, before
    the first backward: ``max(f + max((m − 1)·f, trip) + m·b, m·f + trip_red + b)
    + reduce``. On 1024 H100s the all-reduces of the later stages are most of a
    Llama 70 B's step: without the second trip the bounds missed them.

    ``Pf``: least Σ (f + link_fwd) of the stages before s; ``Pre``: least
    Σ (f + b + reduce + links) before s, plus stage 0's tail; ``Suf``: least
    Σ (f + b + links) after s, ``Suf_red`` the same with their all-reduces
    (memory is not asked: the bounds stay valid, and
    cheap). ``figures(s, i, j)`` gives (fwd, bwd, reduce, tail) no larger than
    the step's own, ``cuts(s, j)`` (link_fwd, link_bwd).

    [Note: bounds with several stages per rank] With v > 1 (Interleaved 1F1B,
    Looped BFS) a rank runs its stages' actions interleaved: stage s's m
    forwards and backwards still lie on one path (its rank's actions, one after
    another, with others between them), micro-batch 0's forwards still reach it,
    and its last backward (micro-batch m − 1's, each stage's last) still sends
    the last gradient back through the stages before it, each all-reducing. So
    the first two bounds hold; the wait term, which counts 1F1B's or GPipe's
    warm-up forwards, is left out (0).

    [Note: bounds under a split backward] The zero-bubble schedules split each
    backward into its input's part (``I``) and its weights' (``W``); a stage's
    all-reduce follows its last ``W``, off the path the gradients take back, and
    the step graph sends nothing between two consecutive stages on one rank
    (ZB-V, DualPipeV). So only the first bound holds, its wait term left out,
    with such a local link's figures counted as 0 (``step_problem`` passes
    them so).

    [Note: bounds under a limit] Called with a ``limit`` (the best step found),
    the least sums range only over the placements that could still reach it:
    a stage holding [i, j) takes at least ``m·(f + b)`` of the step, so a
    placement at or below the limit has no segment above it, and the dynamic
    programs skip those segments. ``floor(s, i, j)`` gives the figures
    without recompute (cheap: no memory asked): non-decreasing in j, so each stage's
    runs are tried only up to the first that exceeds the limit, and a chain of
    n blocks on S stages costs S·n·(blocks per stage) instead of S·n². The
    bounds then hold for every placement whose step is at most the limit (a
    segment none of them holds gets infinity): all that pruning against it
    needs. The states are trimmed likewise: stage s starts at block i only where the
    s stages before it, and the S − s from it, can hold their blocks' work at m·(f + b)
    each within the limit (one of them holds at least an even share of it). A larger
    limit than the tables were made for rebuilds them. ``fits(s, i,
    j)``, when given, is False for a run that cannot fit its stage however it is
    placed, nor can any longer one from i (a memory floor): those are no placement's.
    """

    def __init__(
        self,
        *,
        n_stages: int,
        micro_batches: int,
        schedule: str,
        positions: Sequence[int],
        figures: Callable[[int, int, int], Sequence[float]],
        cuts: Callable[[int, int], Sequence[float]],
        floor: Callable[[int, int, int], Sequence[float]] | None = None,
        fits: Callable[[int, int, int], bool] | None = None,
        virtual: int = 1,
    ) -> None:
        self.S, self.m, self.gpipe = n_stages, micro_batches, schedule == "gpipe"
        self.several = virtual > 1  # [Note: bounds with several stages per rank]
        self.split = schedule in SPLIT_BACKWARD  # [Note: bounds under a split backward]
        self.pos = list(positions)
        self.index = {q: a for a, q in enumerate(self.pos)}
        self.figures, self.cuts = figures, cuts
        self.floor = floor or figures
        self.fits = fits  # False when no longer run from the same start fits either
        self._tables: tuple[list[dict[int, float]], ...] | None = None  # pf, pre, suf, suf_red
        self._limit = math.inf

    def __call__(self, s: int, i: int, j: int, limit: float = math.inf) -> float:
        if self._tables is None or limit > self._limit or limit < self._limit * (1 - 1e-6):
            self._tables = self._build(limit)
            self._limit = limit
        pf, pre, suf, suf_red = self._tables
        inf = math.inf
        f, b, red, tail = self.figures(s, i, j)
        own = self.m * (f + b) + red
        link = sum(self.cuts(s, j)) if s < self.S - 1 else 0.0
        trip = link + suf[s + 1].get(j, inf)  # micro-batch 0 on to the last stage and back
        if self.split:
            return pf[s].get(i, inf) + own + tail
        if self.several:
            wait = 0.0
        elif self.gpipe:  # after its m forwards
            wait = trip
        else:  # [Note: 1F1B's two round trips]
            last_trip = link + suf_red[s + 1].get(j, inf)
            m, w = self.m, min(self.S - s, self.m)
            if w < m:
                wait = max(0.0, trip - (w - 1) * f) + max(0.0, last_trip - (w - 1) * b)
            else:
                wait = max(f + max((m - 1) * f, trip) + m * b, m * f + last_trip + b) - m * (f + b)
        first = pre[s].get(i, inf) + own + (tail if s == 0 else 0) + wait
        return max(pf[s].get(i, inf) + own + tail + wait, first)

    def _ends(self, s: int, i: int, limit: float) -> Iterator[int]:
        """Legal ends j of stage s starting at block i (room left for the later stages),
        while the stage's own least share of the step stays within ``limit``."""
        pos, S = self.pos, self.S
        last = [len(pos) - 1] if s == S - 1 else range(self.index[i] + 1, len(pos) - (S - s - 1))
        for b in last:
            j = pos[b]
            f, bw = self.floor(s, i, j)[:2]
            if self.m * (f + bw) > limit or (self.fits is not None and not self.fits(s, i, j)):
                return
            yield j

    def _balanced(self, limit: float) -> Callable[[int, int], bool]:
        """Whether stage s may start at block i in a placement whose step is ≤ ``limit``:
        the s stages before it hold [0, i), so one of them at least 1/s of its work, and
        a stage's m forwards and backwards lie on one path; likewise the S − s from i."""
        if not math.isfinite(limit):
            return lambda s, i: True
        n, m, stages = self.pos[-1], self.m, range(self.S)

        def least(i: int, j: int) -> float:  # Σ (f + b) of [i, j) on the fastest stage
            return min(sum(self.floor(t, i, j)[:2]) for t in stages) if i < j else 0.0

        head = {i: m * least(0, i) for i in self.pos}
        rest = {i: m * least(i, n) for i in self.pos}
        return lambda s, i: head[i] <= limit * s and rest[i] <= limit * (self.S - s)

    def _build(self, limit: float) -> tuple[list[dict[int, float]], ...]:
        S, inf = self.S, math.inf
        ok = self._balanced(limit)
        pf: list[dict[int, float]] = [{0: 0.0}] + [{} for _ in range(S)]
        pre: list[dict[int, float]] = [{0: 0.0}] + [{} for _ in range(S)]
        for s in range(S - 1):
            for i in list(pf[s]):
                if not ok(s, i):
                    continue
                for j in self._ends(s, i, limit):
                    f, b, red, tail = self.figures(s, i, j)
                    lf, lb = self.cuts(s, j)
                    v = pf[s][i] + f + lf
                    if v < pf[s + 1].get(j, inf):
                        pf[s + 1][j] = v
                    w = pre[s][i] + f + b + red + lf + lb + (tail if s == 0 else 0.0)
                    if w < pre[s + 1].get(j, inf):
                        pre[s + 1][j] = w
        suf: list[dict[int, float]] = [{} for _ in range(S)] + [{self.pos[-1]: 0.0}]
        suf_red: list[dict[int, float]] = [{} for _ in range(S)] + [{self.pos[-1]: 0.0}]
        for s in range(S - 1, 0, -1):
            for i in self.pos[s:-1]:
                if not ok(s, i):
                    continue
                best = best_red = inf
                for j in self._ends(s, i, limit):
                    if j not in suf[s + 1]:
                        continue
                    f, b, red, _ = self.figures(s, i, j)
                    link = sum(self.cuts(s, j)) if s < S - 1 else 0.0
                    best = min(best, f + b + link + suf[s + 1][j])
                    best_red = min(best_red, f + b + red + link + suf_red[s + 1][j])
                if best < inf:
                    suf[s][i], suf_red[s][i] = best, best_red
        return pf, pre, suf, suf_red
