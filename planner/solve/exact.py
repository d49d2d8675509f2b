"""The optimal placement by enumeration and DP, independent of the ILP (for tests)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from planner.solve.feasible import check_feasible
from planner.solve.problem import PartitionProblem
from planner.solve.segments import SegmentCosts

__all__ = ["exact_partition"]


def exact_partition(problem: PartitionProblem) -> tuple[tuple[int, ...], float]:
    """The optimal placement by enumeration + DP, independent of the ILP.

    For each candidate bottleneck θ (a distinct y value, ascending) it runs the
    min-sum DP over segments with y ≤ θ, then tightens the all-reduce cap α
    over distinct r values; T(θ, α) ≤ Σ + (m − 1)·θ + α, with equality at the
    optimum's own (θ, α). Stops once Σ_min + (m − 1)·θ reaches the best found.
    Enumerates every segment that fits in memory: O(S·n²) calls, for tests and
    small chains.

    Returns:
        (starts, objective).

    Raises:
        PartitionInfeasible: no placement fits.
    """
    c = SegmentCosts(problem)
    check_feasible(c)
    S, K, m = c.S, c.K, c.m
    # seg: (s, a, b, w + c, y, r)
    segs = [
        (s, a, b, c.w(s, a, b) + c.cut(s, b), max(c.w(s, a, b), c.cut(s, b)), c.r(s, a, b))
        for s in range(S)
        for a in range(s, c.hi(s) + 1)
        for b in c.ends(s, a, math.inf)
    ]

    def dp(theta: float, alpha: float) -> list[int] | None:
        F = [{0: 0.0}] + [{} for _ in range(S)]
        back: list[dict[int, int]] = [{} for _ in range(S)]
        for s, a, b, cost, y, r in segs:  # ordered by stage, so F[s] is final
            fa = F[s].get(a)
            if fa is None or y > theta or r > alpha:
                continue
            if fa + cost < F[s + 1].get(b, math.inf):
                F[s + 1][b], back[s][b] = fa + cost, a
        if K not in F[S]:
            return None
        idx = [K]
        for s in range(S - 1, -1, -1):
            idx.append(back[s][idx[-1]])
        return idx[::-1]

    base = dp(math.inf, math.inf)
    assert base is not None, "feasibility was checked"
    sum_lb = sum(c.w(s, base[s], base[s + 1]) + c.cut(s, base[s + 1]) for s in range(S))
    best, best_idx = c.objective(base), base
    thetas = sorted({y for *_, y, _ in segs})
    if m == 1:  # no bottleneck term: only the all-reduce cap matters
        thetas = thetas[-1:]
    for theta in thetas[_first(thetas, lambda t: dp(t, math.inf) is not None) :]:
        if sum_lb + (m - 1) * theta >= best:
            break
        idx = dp(theta, math.inf)
        assert idx is not None
        works, cuts, syncs = c.values(idx)
        total = sum(works) + sum(cuts)
        candidates = [idx]
        alphas = sorted({r for *_, y, r in segs if y <= theta and r < max(syncs)})
        # the lambda is called within this iteration, so the late-bound theta is right
        start = _first(alphas, lambda alpha: dp(theta, alpha) is not None)  # noqa: B023
        for alpha in alphas[start:]:
            if total + (m - 1) * theta + alpha >= best:
                break
            got = dp(theta, alpha)
            assert got is not None  # feasibility is monotone in alpha
            candidates.append(got)
        for cand in candidates:
            t = c.objective(cand)
            if t < best:
                best, best_idx = t, cand
    return c.starts(best_idx), best


def _first(values: Sequence[float], ok: Callable[[float], bool]) -> int:
    """Index of the first value where the monotone predicate holds (len if none)."""
    lo, hi = 0, len(values)
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(values[mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo
