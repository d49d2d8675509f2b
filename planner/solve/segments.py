"""Costs of segments and placements: memoised views of a problem's callables, evaluate."""

from __future__ import annotations

import math
from collections.abc import Sequence

from planner.solve.problem import PartitionProblem, placement_indices

__all__ = ["SegmentCosts", "evaluate", "step_time"]


def _checked(value: float, what: str, *, allow_inf: bool = False) -> float:
    v = float(value)
    if not v >= 0 or (v == math.inf and not allow_inf):
        raise ValueError(f"{what} returned {value!r}: costs must be finite numbers ≥ 0")
    return v


class SegmentCosts:
    """Memoised views of a problem's callables, indexed by position (pos[a]).

    Stage s may start at position index a ∈ [s, K − S + s] (``hi``): the s
    stages before it need s positions, the S − 1 − s after it need theirs.
    Work and sync are cached per stage class, memory per stage.
    """

    def __init__(self, p: PartitionProblem) -> None:
        n, S = p.n_blocks, p.n_stages
        allowed = range(1, n) if p.allowed_starts is None else p.allowed_starts
        legal = sorted(set(allowed) - {0})
        self.p, self.n, self.S, self.m = p, n, S, p.micro_batches
        self.pos = [0, *legal, n]
        self.K = len(self.pos) - 1
        labels = p.stage_class if p.stage_class is not None else range(S)
        dense: dict[int, int] = {}
        self.cls = [dense.setdefault(c, len(dense)) for c in labels]
        self.cap = [float(c) for c in p.capacity]
        self._w: dict[int, float] = {}
        self._r: dict[int, float] = {}
        self._mem: dict[int, float] = {}
        self._cut: dict[int, float] = {}
        self._top: dict[int, tuple[float, int, int]] = {}  # stage -> last (wcap, a, end) walked
        self._fit: dict[int, tuple[int, int]] = {}  # stage -> a run (a, b) known to fit

    def hi(self, s: int) -> int:
        return self.K - self.S + s

    def _key(self, c: int, a: int, b: int) -> int:
        return (c * (self.K + 1) + a) * (self.K + 1) + b

    def w(self, s: int, a: int, b: int) -> float:
        key = self._key(self.cls[s], a, b)
        v = self._w.get(key)
        if v is None:
            i, j = self.pos[a], self.pos[b]
            v = self._w[key] = _checked(self.p.seg_work(s, i, j), f"seg_work({s}, {i}, {j})")
        return v

    def r(self, s: int, a: int, b: int) -> float:
        key = self._key(self.cls[s], a, b)
        v = self._r.get(key)
        if v is None:
            i, j = self.pos[a], self.pos[b]
            v = self._r[key] = _checked(self.p.seg_sync(s, i, j), f"seg_sync({s}, {i}, {j})")
        return v

    def mem(self, s: int, a: int, b: int) -> float:
        key = self._key(s, a, b)
        v = self._mem.get(key)
        if v is None:
            i, j = self.pos[a], self.pos[b]
            fn = self.p.seg_memory
            v = self._mem[key] = _checked(fn(s, i, j), f"seg_memory({s}, {i}, {j})", allow_inf=True)
        return v

    def cut(self, s: int, b: int) -> float:
        if s >= self.S - 1 or s < 0:
            return 0.0
        key = s * (self.K + 1) + b
        v = self._cut.get(key)
        if v is None:
            j = self.pos[b]
            v = self._cut[key] = _checked(self.p.cut_time(s, j), f"cut_time({s}, {j})")
        return v

    def fits(self, s: int, a: int, b: int, wcap: float) -> bool:
        return self.w(s, a, b) <= wcap and self.mem(s, a, b) <= self.cap[s]

    def ends(self, s: int, a: int, wcap: float) -> range:
        """Ends b of stage s's segments from a with work ≤ wcap that fit its memory.

        Both are monotone in b, so the ends form a range, and its end does not
        fall as a grows: callers that ask the starts of a stage in increasing
        order (every one here) get each end walked from the last answer's, and
        memory asked about once per run of starts (see :meth:`_mem_end`).
        """
        if s == self.S - 1:
            return range(self.K, self.K + 1) if self.fits(s, a, self.K, wcap) else range(0)
        hi = self.hi(s + 1)
        top = a
        last = self._top.get(s)
        if last is not None and last[0] == wcap and last[1] <= a:
            top = max(a, last[2])  # w(s, a, top) ≤ w(s, last a, top) ≤ wcap
        while top < hi and self.w(s, a, top + 1) <= wcap:
            top += 1
        self._top[s] = (wcap, a, top)
        return range(a + 1, self._mem_end(s, a, top) + 1)

    def _mem_end(self, s: int, a: int, top: int) -> int:
        """The last end b ≤ top with [a, b) in stage s's memory (a if none).

        A run that fits has every sub-run fit, so a fitting [a', b') with a' ≤ a
        answers every b ≤ b' without asking. When memory must be asked, a run
        twice as long is asked first: when it fits, it answers the next starts
        too (one question per run of starts instead of one per start).
        """
        if top <= a:
            return a
        known = self._fit.get(s)
        if known is not None and known[0] <= a and top <= known[1]:
            return top
        cap = self.cap[s]
        ahead = min(self.hi(s + 1), top + (top - a))
        if ahead > top and self.mem(s, a, ahead) <= cap:
            self._fit[s] = (a, ahead)
            return top
        if self.mem(s, a, top) <= cap:
            self._fit[s] = (a, top)
            return top
        lo, hi = a, top - 1  # memory holds at lo (vacuously), find the last b < top where it holds
        if known is not None and known[0] <= a:
            lo = max(lo, min(known[1], hi))
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.mem(s, a, mid) <= cap:
                lo = mid
            else:
                hi = mid - 1
        if lo > a:
            self._fit[s] = (a, lo)
        return lo

    def indices(self, starts: Sequence[int]) -> list[int]:
        """Position indices of a placement (with K appended); ValueError if malformed."""
        return placement_indices(self.pos, self.S, starts)

    def values(self, idx: Sequence[int]) -> tuple[list[float], list[float], list[float]]:
        """Per-stage work, cuts (S − 1) and sync of a placement in index form."""
        S = self.S
        works = [self.w(s, idx[s], idx[s + 1]) for s in range(S)]
        cuts = [self.cut(s, idx[s + 1]) for s in range(S - 1)]
        syncs = [self.r(s, idx[s], idx[s + 1]) for s in range(S)]
        return works, cuts, syncs

    def objective(self, idx: Sequence[int]) -> float:
        works, cuts, syncs = self.values(idx)
        return step_time(self.m, works, cuts, syncs)

    def starts(self, idx: Sequence[int]) -> tuple[int, ...]:
        return tuple(self.pos[a] for a in idx[:-1])


def step_time(
    m: int, works: Sequence[float], cuts: Sequence[float], syncs: Sequence[float]
) -> float:
    return sum(works) + sum(cuts) + (m - 1) * max([*works, *cuts]) + max(syncs)


def evaluate(problem: PartitionProblem, starts: Sequence[int]) -> float:
    """The step time T of a placement (memory is not checked).

    Example::

        evaluate(problem, (0, 5, 11))   # stage 0: blocks 0..4, stage 1: 5..10, ...

    Raises:
        ValueError: starts malformed or not at allowed split points.
    """
    c = SegmentCosts(problem)
    return c.objective(c.indices(starts))
