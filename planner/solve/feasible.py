"""Whether any placement fits (and why not), and a fast good placement: the heuristic."""

from __future__ import annotations

import math
import time

from planner.solve.problem import (
    PartitionInfeasible,
    PartitionProblem,
    unfit_block,
    unfit_last,
    unfit_stage,
    unfit_whole,
)
from planner.solve.segments import SegmentCosts

__all__ = ["check_feasible", "heuristic", "heuristic_partition", "tie_break"]


def _reach(c: SegmentCosts, wcap: float) -> tuple[list[list[int]], int | None]:
    """Start indices each stage can reach with every segment's y ≤ wcap and in memory.

    Returns (reach per stage, the last stage's chosen start or None if the last
    stage cannot finish). The ends of stage s form a union of runs (a, bmax(a)]
    with bmax non-decreasing in a (monotone costs), so one sweep per stage does
    (:meth:`SegmentCosts.ends` walks each from the last).
    """
    R: list[list[int]] = [[0]]
    for s in range(c.S - 1):
        nxt: list[int] = []
        b = covered = 0
        for a in R[s]:
            b = max(b, a, c.ends(s, a, wcap).stop - 1)
            nxt.extend(e for e in range(max(a, covered) + 1, b + 1) if c.cut(s, e) <= wcap)
            covered = max(covered, b)
        R.append(nxt)
        if not nxt:
            return R, None
    last = R[-1][-1]  # the latest start is the cheapest for the last stage
    return R, (last if c.fits(c.S - 1, last, c.K, wcap) else None)


def check_feasible(c: SegmentCosts, *, reach: bool = True) -> None:
    """Raise PartitionInfeasible naming the constraint family that cannot be met.

    ``reach=False``: only the checks that cost O(K) (split points, each run
    between them fitting some stage); whether whole placements fit is then
    left to :func:`heuristic`, which finds one or raises through this check.
    """
    p, S, K = c.p, c.S, c.K
    if S > K:
        if p.allowed_starts is None:
            raise PartitionInfeasible(
                f"{S} stages need {S - 1} split points but {p.n_blocks} blocks have only "
                f"{p.n_blocks - 1}.\n  fix: use at most {p.n_blocks} stages, or finer blocks"
            )
        raise PartitionInfeasible(
            f"stage {K} has no legal start: {S} stages need {S - 1} split points, "
            f"{K - 1} allowed.\n  fix: use at most {K} stages, or allow more split points"
        )
    for a in range(K):  # each run between legal split points must fit some stage
        stages = range(max(0, a - (K - S)), min(a, S - 1) + 1)
        if any(c.mem(s, a, a + 1) <= c.cap[s] for s in stages):
            continue
        need, s = min((c.mem(s, a, a + 1), s) for s in stages)
        what = p.block_label(c.pos[a], c.pos[a + 1])
        if c.pos[a + 1] - c.pos[a] > 1:
            what += " (no legal split point between them)"
        room = max(c.cap[t] for t in stages)
        raise PartitionInfeasible(unfit_block(what, room, need, s, c.cap[s]))
    if not reach:
        return
    R, last = _reach(c, math.inf)
    if last is not None:
        return
    s = len(R) - 1
    if S == 1:
        whole = p.block_label(0, p.n_blocks)
        raise PartitionInfeasible(unfit_whole(whole, c.mem(0, 0, K), c.cap[0]))
    if R[-1]:  # the last stage cannot take what the others leave
        a = R[-1][-1]
        left = p.block_label(c.pos[a], p.n_blocks)
        raise PartitionInfeasible(unfit_last(S, left, c.mem(S - 1, a, K), c.cap[S - 1]))
    need = min(c.mem(s - 1, a, a + 1) for a in R[s - 1])
    raise PartitionInfeasible(unfit_stage(S, s - 1, c.cap[s - 1], need))


# ---------------------------------------------------------------- ties

_TIE = 1e-12  # relative: step times this close are equal (float sums in another order)


def tie_break(c: SegmentCosts, idx: list[int]) -> list[int]:
    """The placement with the earliest split points among those of the same step time.

    [Note: tie-breaking] Equal-cost placements are common: a block that costs nothing
    (a ReLU at a stage boundary) can go either side, and with one micro-batch the step
    time is a plain sum, so any boundary between equal-cost neighbours is optimal.
    Which one a solve finds depends on its route (the heuristic, the pruning's sweeps,
    the ILP), so every answer is brought to one form: each split point, first to last
    and again until none moves, steps to an earlier legal position while the step time
    stays within ``_TIE`` of the original (sums in another order differ in the last
    bits) and both stages it touches fit in memory. The last placement of that walk
    whose step time is not above the original's, bit for bit, is the answer.
    """
    start = c.objective(idx)
    limit = start * (1 + _TIE)
    walk, answer = list(idx), list(idx)
    moved = True
    while moved:
        moved = False
        for k in range(1, c.S):
            while walk[k] - 1 > walk[k - 1]:
                trial = [*walk[:k], walk[k] - 1, *walk[k + 1 :]]
                if (
                    c.mem(k - 1, trial[k - 1], trial[k]) > c.cap[k - 1]
                    or c.mem(k, trial[k], trial[k + 1]) > c.cap[k]
                    or c.objective(trial) > limit
                ):
                    break
                walk, moved = trial, True
                if c.objective(walk) <= start:
                    answer = walk
    return answer


# ---------------------------------------------------------------- heuristic


def _min_sum_path(c: SegmentCosts, wcap: float) -> list[int] | None:
    """The placement of least Σ(w + c) with every y ≤ wcap (DP), or None."""
    F: dict[int, float] = {0: 0.0}
    back: list[dict[int, int]] = []
    for s in range(c.S):
        nF: dict[int, float] = {}
        bk: dict[int, int] = {}
        for a in sorted(F):
            for b in c.ends(s, a, wcap):
                cut = c.cut(s, b)
                if cut > wcap:
                    continue
                v = F[a] + c.w(s, a, b) + cut
                if v < nF.get(b, math.inf):
                    nF[b], bk[b] = v, a
        if not nF:
            return None
        F = nF
        back.append(bk)
    idx = [c.K]
    for s in range(c.S - 1, -1, -1):
        idx.append(back[s][idx[-1]])
    return idx[::-1]


def heuristic(c: SegmentCosts, deadline: float = math.inf) -> list[int] | None:
    """Bisect the least feasible bottleneck, then take min-sum placements under it.

    The bracket is found by doubling from the work of an even split (every
    cap asked only walks segments up to about twice the answer, not the whole
    chain); when no cap fits, neither does any placement and
    :func:`check_feasible` says why (PartitionInfeasible).

    Returns position indices (K appended), or None if the deadline passed first.
    """
    w_max = max(c.w(s, 0, c.K) for s in range(c.S))
    hi = w_max / c.S if w_max > 0 else 1.0
    lo = 0.0
    checked = False
    while _reach(c, hi)[1] is None:
        lo, hi = hi, 2 * hi
        if hi > w_max and not checked:
            checked = True
            if _reach(c, math.inf)[1] is None:
                check_feasible(c)  # raises: no cap lets a placement through
                raise PartitionInfeasible("no placement fits every stage's memory")
    for _ in range(60):
        if time.perf_counter() > deadline:
            return None
        if hi - lo <= 1e-3 * hi:
            break
        mid = (lo + hi) / 2
        if _reach(c, mid)[1] is not None:
            hi = mid
        else:
            lo = mid
    ladder = [hi, hi * 1.01, hi * 1.05] + ([math.inf] if c.m == 1 else [])
    best: tuple[float, list[int]] | None = None
    for cap in ladder:
        if time.perf_counter() > deadline and best is not None:
            break
        idx = _min_sum_path(c, cap)
        if idx is not None and (best is None or c.objective(idx) < best[0]):
            best = (c.objective(idx), idx)
    assert best is not None, "the bisection's cap is feasible"
    return best[1]


def heuristic_partition(problem: PartitionProblem) -> tuple[int, ...]:
    """A fast, good placement: the least bottleneck, then the least total under it.

    Bisects the smallest cap on every stage's work and cut that a placement can
    meet (memory and split points respected), then runs a min-sum DP under a
    few caps at and just above it, keeping the one of least step time. Not
    optimal in general (the ILP is); it is the ILP's warm start.

    Example::

        heuristic_partition(problem)   # (0, 7, 15, 22)

    Raises:
        PartitionInfeasible: no placement fits (the message names why).
    """
    c = SegmentCosts(problem)
    check_feasible(c, reach=False)
    idx = heuristic(c)
    assert idx is not None
    return c.starts(idx)
