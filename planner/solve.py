"""Place a chain of blocks on pipeline stages: an exact ILP over contiguous segments.

Usage::

    problem = PartitionProblem(
        n_blocks=4, n_stages=2, micro_batches=8,
        seg_work=lambda s, i, j: sum(ms[i:j]), seg_memory=lambda s, i, j: 0.0,
        capacity=[80e9, 80e9],
    )
    sol = solve_partition(problem)
    sol.starts      # (0, 2): stage 0 holds blocks [0, 2), stage 1 holds [2, 4)

Pure: numbers and callables in, an assignment out. It imports PuLP, never torch.

The step time of a placement (GPipe / 1F1B in flow-shop form)::

    T = Σ_s w_s + Σ_s c_s + (m − 1)·max(max_s w_s, max_s c_s) + max_s r_s

w_s: stage s's work per micro-batch, c_s: the link s → s+1 per micro-batch,
r_s: stage s's exposed gradient all-reduce, m: micro-batches.

The segment ILP (symbols as in the code)
----------------------------------------
Positions ``pos[0] = 0 < pos[1] < … < pos[K-1] < pos[K] = n`` are the legal
stage starts followed by the end of the chain. A segment ``(s, a, b)`` means
"stage s holds blocks [pos[a], pos[b])"; it carries

    w[s,a,b] = seg_work(s, pos[a], pos[b])     c[s,b] = cut_time(s, pos[b])  (0 for s = S−1)
    y[s,a,b] = max(w[s,a,b], c[s,b])            r[s,a,b] = seg_sync(s, pos[a], pos[b])

and one binary ``x[s,a,b]``::

    minimise    Σ x[s,a,b]·(w[s,a,b] + c[s,b]) + (m − 1)·W + A
    subject to  Σ_b x[0,0,b] = 1                                  stage 0 starts at block 0
                Σ_a' x[s−1,a',a] = Σ_b x[s,a,b]    s ≥ 1, all a    s starts where s−1 ends
                W ≥ Σ_{a,b} y[s,a,b]·x[s,a,b]      every s         W ≥ each work and cut
                A ≥ Σ_{a,b} r[s,a,b]·x[s,a,b]      every s         A ≥ each all-reduce
                W ≥ W_lb,  A ≥ A_lb                                 root bounds (below)

The segments form a layered DAG from (0, 0) to (S, K); a feasible x is a path
through it with one segment per stage, and the last stage's segments all end
at K. Because each stage picks exactly one segment, the aggregated rows
``W ≥ Σ y·x`` equal that segment's value: one row per stage instead of one per
segment, and a tighter LP relaxation.

[Note: segment pruning] Only segments that can appear in a placement better
than an incumbent U (the heuristic's, or a warm start) become variables. Any
stage forces T ≥ m·y, so first y ≤ U/m: the ends of each (s, a) are walked
upward until work exceeds that cap, and memory (monotone too) is bisected.
Then rounds of DP sweeps bound every segment from below. For a *bucket*
(ylo, ycap] × (rlo, rcap], let F[s][a] be the least Σ(w + c) of stages
0..s−1 covering blocks [0, pos[a]) and G[s][b] the least of stages s..S−1
covering [pos[b], n), both using only segments with y ≤ ycap and r ≤ rcap.
A placement through (s, a, b) whose bottleneck Y = max y lies in (ylo, ycap]
and whose A = max r lies in (rlo, rcap] has

    T ≥ F[s][a] + w + c[s,b] + G[s+1][b] + (m − 1)·max(ylo, y, c[s−1,a]) + max(rlo, r)

A *family* of buckets covers every placement that could beat U (Y ≤ Y_top =
(U − Σ_lb − A_lb)/(m − 1), A ≤ U − Σ_lb − (m − 1)·W_lb), so the least bound
over a family's buckets that admit the segment is a valid bound; three
families (a grid on Y, one on A, a coarse 2-D grid) give three, and the
segment goes when the largest exceeds U. Each sweep's least-Σ placement is
also a candidate incumbent, so U falls as the rounds go. Rounds repeat, with
finer grids as the set shrinks, until nothing changes (or the deadline).
With fine enough buckets this is an exact DP by itself; the ILP is what
proves the rest and reports a gap when stopped early.

[Note: root bounds] Over the surviving DAG, W_lb = min over placements of
the largest y (a bottleneck-path DP), A_lb the same for r, Σ_lb = least
Σ(w + c). Each bucket family gives T ≥ min over its buckets of
(G[0][0] + (m − 1)·ylo + rlo); ``root`` is the largest. All hold per stage
index, so they are valid for heterogeneous stages. They are what the LP
relaxation misses (it averages the max terms), and they are our lower bound
when a solver reports none (or a weaker one).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import re
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import pulp

__all__ = [
    "SOLVERS",
    "PartitionInfeasible",
    "PartitionProblem",
    "PartitionSolution",
    "PartitionTimeout",
    "SolverUnavailable",
    "evaluate",
    "exact_partition",
    "heuristic_partition",
    "solve_partition",
]

log = logging.getLogger(__name__)

SegFn = Callable[[int, int, int], float]
CutFn = Callable[[int, int], float]
Status = Literal["optimal", "time_limit", "heuristic"]

SOLVERS = ("auto", "highs", "cbc")
_MIP_REL_GAP = 1e-7  # "optimal" means proven within this relative gap
_TOL = 1e-9  # relative slack when comparing bounds with the incumbent


class PartitionInfeasible(ValueError):
    """No placement satisfies the memory and split-point constraints."""


class PartitionTimeout(RuntimeError):
    """The time limit ran out before any placement was found."""


class SolverUnavailable(RuntimeError):
    """The requested ILP solver is not installed."""


def _zero_cut(s: int, j: int) -> float:
    return 0.0


def _zero_seg(s: int, i: int, j: int) -> float:
    return 0.0


@dataclass(frozen=True, kw_only=True)
class PartitionProblem:
    """A chain of blocks to place on pipeline stages.

    Every callable takes stage indices and block indices; ``[i, j)`` is the run
    of blocks a stage holds. Work and sync must be non-decreasing in j and
    non-increasing in i (a longer run never costs less), and so must "fits in
    memory" (memory itself may drop, e.g. when recompute kicks in, as long as
    a run that does not fit never fits once extended): the pruning relies on it.

    Attributes:
        n_blocks: blocks in the chain (≥ 1).
        n_stages: pipeline stages S (≥ 1); each gets ≥ 1 block, in order.
        micro_batches: m ≥ 1 micro-batches per step.
        seg_work: (s, i, j) -> per-micro-batch time of stage s holding [i, j).
        seg_memory: (s, i, j) -> peak bytes of stage s holding [i, j).
        capacity: bytes each stage's device holds (``math.inf``: no limit).
        cut_time: (s, j) -> per-micro-batch transfer time on the link s → s+1
            when stage s+1 starts at block j (1 ≤ j ≤ n−1). Default: free.
        seg_sync: (s, i, j) -> exposed gradient all-reduce time of stage s
            holding [i, j); 0 when dp = 1 (the default).
        allowed_starts: blocks where a stage may start; block 0 always starts
            stage 0. None: every block.
        stage_class: per stage, a label; stages with equal labels have
            identical seg_work and seg_sync (same device type), so those are
            evaluated once per label. Memory is still asked per stage.
        block_names: per block, a name for messages (e.g. its split point).
    """

    n_blocks: int
    n_stages: int
    micro_batches: int
    seg_work: SegFn
    seg_memory: SegFn
    capacity: Sequence[float]
    cut_time: CutFn = _zero_cut
    seg_sync: SegFn = _zero_seg
    allowed_starts: frozenset[int] | None = None
    stage_class: Sequence[int] | None = None
    block_names: Sequence[str] | None = None

    def __post_init__(self) -> None:
        for name in ("n_blocks", "n_stages", "micro_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer ≥ 1 (got {value!r})")
        for name in ("seg_work", "seg_memory", "cut_time", "seg_sync"):
            if not callable(getattr(self, name)):
                raise ValueError(f"{name} must be callable (got {getattr(self, name)!r})")
        if len(self.capacity) != self.n_stages:
            raise ValueError(
                f"capacity has {len(self.capacity)} entries for {self.n_stages} stages: "
                "give one per stage"
            )
        for s, cap in enumerate(self.capacity):
            if not cap > 0:  # also rejects NaN
                raise ValueError(f"capacity[{s}] must be > 0 bytes (got {cap!r})")
        if self.allowed_starts is not None:
            bad = sorted(j for j in self.allowed_starts if not 0 <= j < self.n_blocks)
            if bad:
                raise ValueError(
                    f"allowed_starts must lie in 0..{self.n_blocks - 1} (got {bad[:5]})"
                )
        if self.stage_class is not None and len(self.stage_class) != self.n_stages:
            raise ValueError(
                f"stage_class has {len(self.stage_class)} entries for {self.n_stages} "
                "stages: give one label per stage"
            )
        if self.block_names is not None and len(self.block_names) != self.n_blocks:
            raise ValueError(
                f"block_names has {len(self.block_names)} entries for {self.n_blocks} blocks"
            )

    def block_label(self, i: int, j: int | None = None) -> str:
        """'block 3 ('layers.2')' or 'blocks 3..5', for messages."""
        names = self.block_names
        if j is None or j == i + 1:
            return f"block {i}" + (f" ({names[i]!r})" if names else "")
        return f"blocks {i}..{j - 1}" + (f" ({names[i]!r}..{names[j - 1]!r})" if names else "")


@dataclass(frozen=True, kw_only=True)
class PartitionSolution:
    """A placement and how sure we are of it.

    Attributes:
        starts: first block of each stage; ``starts[0] == 0``.
        objective: its step time T (units of the cost callables).
        stage_work, cut_times, stage_sync, stage_memory: per stage (cut_times
            per link, S − 1 of them) values of the placement.
        status: "optimal": proven within a relative gap of 1e-7 (by the
            solver, or by our bounds alone); "time_limit": the limit stopped
            the search first (before or during the ILP), this is the best
            placement found; "heuristic": the solver ended for another reason
            without a better placement, this is the incumbent (see
            solver_status).
        gap: (objective − bound) / objective; ≤ 1e-7 when optimal.
        bound: the best proven lower bound on T: the solver's dual bound
            (HiGHS's mip_dual_bound, CBC's "Lower bound" line) or our root
            bound, whichever is higher.
        solver: "highs" or "cbc".
        solve_s: wall seconds of the whole call.
        n_segments: binaries in the ILP after pruning.
        solver_status: the solver's own words, for the record.
    """

    starts: tuple[int, ...]
    objective: float
    stage_work: tuple[float, ...]
    cut_times: tuple[float, ...]
    stage_sync: tuple[float, ...]
    stage_memory: tuple[float, ...]
    status: Status
    gap: float | None
    bound: float | None
    solver: str
    solve_s: float
    n_segments: int
    solver_status: str = ""


def _fmt_bytes(x: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= size:
            return f"{x / size:.1f} {unit}"
    return f"{x:.0f} B"


def _checked(value: float, what: str, *, allow_inf: bool = False) -> float:
    v = float(value)
    if not v >= 0 or (v == math.inf and not allow_inf):
        raise ValueError(f"{what} returned {value!r}: costs must be finite numbers ≥ 0")
    return v


class _Costs:
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

        Work is walked end by end (every value is needed later anyway); memory,
        asked per stage, is bisected. Both are monotone in b, so the ends form
        a range.
        """
        if s == self.S - 1:
            return range(self.K, self.K + 1) if self.fits(s, a, self.K, wcap) else range(0)
        top = a
        while top < self.hi(s + 1) and self.w(s, a, top + 1) <= wcap:
            top += 1
        lo, hi = a, top  # memory holds at lo (vacuously), find the last b ≤ top where it holds
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.mem(s, a, mid) <= self.cap[s]:
                lo = mid
            else:
                hi = mid - 1
        return range(a + 1, lo + 1)

    def indices(self, starts: Sequence[int]) -> list[int]:
        """Position indices of a placement (with K appended); ValueError if malformed."""
        where = {p: a for a, p in enumerate(self.pos[:-1])}
        starts = list(starts)
        if len(starts) != self.S or not starts or starts[0] != 0:
            raise ValueError(f"starts must have {self.S} entries beginning with 0 (got {starts})")
        if any(x >= y for x, y in itertools.pairwise(starts)):
            raise ValueError(f"starts must increase strictly (got {starts})")
        bad = [j for j in starts if j not in where]
        if bad:
            raise ValueError(f"starts {bad} are not allowed split points (or ≥ n_blocks)")
        return [where[j] for j in starts] + [self.K]

    def values(self, idx: Sequence[int]) -> tuple[list[float], list[float], list[float]]:
        """Per-stage work, cuts (S − 1) and sync of a placement in index form."""
        S = self.S
        works = [self.w(s, idx[s], idx[s + 1]) for s in range(S)]
        cuts = [self.cut(s, idx[s + 1]) for s in range(S - 1)]
        syncs = [self.r(s, idx[s], idx[s + 1]) for s in range(S)]
        return works, cuts, syncs

    def objective(self, idx: Sequence[int]) -> float:
        works, cuts, syncs = self.values(idx)
        return _step_time(self.m, works, cuts, syncs)

    def starts(self, idx: Sequence[int]) -> tuple[int, ...]:
        return tuple(self.pos[a] for a in idx[:-1])


def _step_time(
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
    c = _Costs(problem)
    return c.objective(c.indices(starts))


# ---------------------------------------------------------------- feasibility


def _reach(c: _Costs, wcap: float) -> tuple[list[list[int]], int | None]:
    """Start indices each stage can reach with every segment's y ≤ wcap and in memory.

    Returns (reach per stage, the last stage's chosen start or None if the last
    stage cannot finish). The ends of stage s form a union of runs (a, bmax(a)]
    with bmax non-decreasing in a (monotone costs), so one sweep per stage does.
    """
    R: list[list[int]] = [[0]]
    for s in range(c.S - 1):
        nxt: list[int] = []
        b = covered = 0
        for a in R[s]:
            b = max(b, a)
            while b < c.hi(s + 1) and c.fits(s, a, b + 1, wcap):
                b += 1
            nxt.extend(e for e in range(max(a, covered) + 1, b + 1) if c.cut(s, e) <= wcap)
            covered = max(covered, b)
        R.append(nxt)
        if not nxt:
            return R, None
    last = R[-1][-1]  # the latest start is the cheapest for the last stage
    return R, (last if c.fits(c.S - 1, last, c.K, wcap) else None)


def _check_feasible(c: _Costs) -> None:
    """Raise PartitionInfeasible naming the constraint family that cannot be met."""
    p, S, K = c.p, c.S, c.K
    if S > K:
        if p.allowed_starts is None:
            raise PartitionInfeasible(
                f"{S} stages need {S - 1} split points but {p.n_blocks} blocks have only "
                f"{p.n_blocks - 1}: use at most {p.n_blocks} stages, or finer blocks"
            )
        raise PartitionInfeasible(
            f"stage {K} has no legal start: {S} stages need {S - 1} split points, "
            f"{K - 1} allowed; use at most {K} stages, or allow more split points"
        )
    for a in range(K):  # each run between legal split points must fit some stage
        stages = range(max(0, a - (K - S)), min(a, S - 1) + 1)
        if any(c.mem(s, a, a + 1) <= c.cap[s] for s in stages):
            continue
        need, s = min((c.mem(s, a, a + 1), s) for s in stages)
        what = p.block_label(c.pos[a], c.pos[a + 1])
        if c.pos[a + 1] - c.pos[a] > 1:
            what += " (no legal split point between them)"
        raise PartitionInfeasible(
            f"no stage can hold {what} within {_fmt_bytes(max(c.cap[t] for t in stages))}: "
            f"it needs {_fmt_bytes(need)} on stage {s} (capacity {_fmt_bytes(c.cap[s])}). "
            "Recompute activations, use fewer samples per micro-batch, split the block, "
            "or give the stage a device with more memory"
        )
    R, last = _reach(c, math.inf)
    if last is not None:
        return
    s = len(R) - 1
    if R[-1]:  # the last stage cannot take what the others leave
        a = R[-1][-1]
        need, cap = c.mem(S - 1, a, K), c.cap[S - 1]
        raise PartitionInfeasible(
            f"the blocks do not fit in the memory of {S} stages: filling stages 0..{S - 2} "
            f"as far as memory allows leaves {p.block_label(c.pos[a], p.n_blocks)} for "
            f"stage {S - 1}, needing {_fmt_bytes(need)} against {_fmt_bytes(cap)}. "
            "Use more stages or larger devices, recompute activations, or fewer samples "
            "per micro-batch"
        )
    need = min(c.mem(s - 1, a, a + 1) for a in R[s - 1])
    raise PartitionInfeasible(
        f"the blocks do not fit in the memory of {S} stages: stage {s - 1} "
        f"({_fmt_bytes(c.cap[s - 1])}) cannot hold any run of blocks where stages "
        f"0..{s - 2} can end (the smallest needs {_fmt_bytes(need)}). Use larger devices "
        "for it, recompute activations, or fewer samples per micro-batch"
    )


# ---------------------------------------------------------------- heuristic


def _min_sum_path(c: _Costs, wcap: float) -> list[int] | None:
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


def _heuristic(c: _Costs, deadline: float = math.inf) -> list[int] | None:
    """Bisect the least feasible bottleneck, then take min-sum placements under it.

    Returns position indices (K appended), or None if the deadline passed first.
    """
    hi = max(
        max(c.w(s, 0, c.K) for s in range(c.S)),
        *(c.cut(s, b) for s in range(c.S - 1) for b in range(s + 1, c.hi(s + 1) + 1)),
        0.0,
    )
    lo = 0.0
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
    c = _Costs(problem)
    _check_feasible(c)
    idx = _heuristic(c)
    assert idx is not None
    return c.starts(idx)


# ---------------------------------------------------------------- exact DP


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
    c = _Costs(problem)
    _check_feasible(c)
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


# ---------------------------------------------------------------- pruning

# per stage: {start index a: [(end index b, w, cut, r), ...]}; r < 0 means "not asked yet"
_Layer = dict[int, list[tuple[int, float, float, float]]]
_Table = list[dict[int, float]]
_ROUNDS = 20  # pruning rounds at most (each only removes segments)
# Buckets per round: a family gets 8·k (2-D: (3·k)²) with k = √(_BUCKET_BUDGET / segments)
# clamped to 1..4, so a shrinking set gets finer buckets for about the same cost.
_BUCKET_BUDGET = 2e5


@dataclass(frozen=True)
class _Segments:
    layers: list[_Layer]
    w_lb: float
    a_lb: float
    root: float  # a lower bound on every placement's T: see [Note: root bounds]
    incumbent: list[int]  # the best placement seen (index form)

    @property
    def count(self) -> int:
        return sum(len(row) for layer in self.layers for row in layer.values())


def _sweeps(
    c: _Costs, layers: list[_Layer], ycap: float, rcap: float
) -> tuple[_Table, _Table, list[int] | None]:
    """F, G over segments with y ≤ ycap and r ≤ rcap, and the least-Σ placement among them."""
    S = c.S
    F: _Table = [{0: 0.0}] + [{} for _ in range(S)]
    back: list[dict[int, int]] = [{} for _ in range(S)]
    for s in range(S):
        Fs, Fn, bk = F[s], F[s + 1], back[s]
        for a, row in layers[s].items():
            fa = Fs.get(a)
            if fa is None:
                continue
            for b, w, cut, r in row:
                if w <= ycap and cut <= ycap and r <= rcap and fa + w + cut < Fn.get(b, math.inf):
                    Fn[b], bk[b] = fa + w + cut, a
    G: _Table = [{} for _ in range(S)] + [{c.K: 0.0}]
    for s in range(S - 1, -1, -1):
        Gn, Gs = G[s + 1], G[s]
        for a, row in layers[s].items():
            best = math.inf
            for b, w, cut, r in row:
                if w <= ycap and cut <= ycap and r <= rcap and b in Gn and w + cut + Gn[b] < best:
                    best = w + cut + Gn[b]
            if best < math.inf:
                Gs[a] = best
    if c.K not in F[S]:
        return F, G, None
    idx = [c.K]
    for s in range(S - 1, -1, -1):
        idx.append(back[s][idx[-1]])
    return F, G, idx[::-1]


def _bottleneck(layers: list[_Layer], value: Callable[[float, float, float], float]) -> float:
    """min over placements of max over stages of value(w, cut, r) (bottleneck-path DP)."""
    B: dict[int, float] = {0: 0.0}
    for layer in layers:
        nB: dict[int, float] = {}
        for a, row in layer.items():
            if a in B:
                for b, w, cut, r in row:
                    v = max(B[a], value(w, cut, r))
                    if v < nB.get(b, math.inf):
                        nB[b] = v
        B = nB
    return min(B.values())


def _grid(lo: float, top: float, n: int) -> list[tuple[float, float]]:
    """(bucket floor, bucket cap) pairs covering (lo, top]; one open bucket if top is inf."""
    if n == 1 or math.isinf(top) or top <= lo:
        return [(lo, max(top, lo))]
    caps = [lo + (top - lo) * k / n for k in range(1, n)] + [top]
    return list(zip([lo, *caps], caps, strict=False))


def _prune(c: _Costs, U: float, incumbent: Sequence[int], deadline: float = math.inf) -> _Segments:
    """The segments that can be in a placement with T ≤ U: see [Note: segment pruning].

    The first round always runs (the ILP needs it); later rounds stop at the deadline.
    """
    S, m, inf = c.S, c.m, math.inf
    inc = list(incumbent)
    layers: list[_Layer] = []
    reach, wcap = {0}, U / m * (1 + _TOL)
    for s in range(S):  # forward, so only reachable starts are walked
        layer: _Layer = {}
        ok = range(s + 1, c.hi(s + 1) + 1) if s < S - 1 else range(c.K, c.K + 1)
        cuts = [c.cut(s, b) if b in ok else inf for b in range(c.K + 1)]
        for a in sorted(reach):
            row = [(b, c.w(s, a, b), cuts[b], -1.0) for b in c.ends(s, a, wcap) if cuts[b] <= wcap]
            if row:
                layer[a] = row
        layers.append(layer)
        reach = {seg[0] for row in layer.values() for seg in row}
    count, first = -1, True
    for round_ in range(_ROUNDS):
        if round_ > 0 and time.perf_counter() > deadline:
            break
        w_lb = _bottleneck(layers, lambda w, cut, r: max(w, cut))
        a_lb = 0.0 if first else _bottleneck(layers, lambda w, cut, r: r)
        sum_lb = _sweeps(c, layers, inf, inf)[1][0][0]
        slack = _TOL * max(1.0, abs(U))
        # Bucket (ylo, ycap, rlo, rcap): placements whose bottleneck Y lies in (ylo, ycap]
        # and whose all-reduce A lies in (rlo, rcap]. A family of buckets covers every
        # placement that could beat U; each family gives a lower bound, the larger wins.
        y_top = (U + slack - sum_lb - a_lb) / (m - 1) if m > 1 and not first else inf
        r_top = U + slack - sum_lb - (m - 1) * w_lb if not first else inf
        scale = min(4.0, max(1.0, (_BUCKET_BUDGET / max(count, 1)) ** 0.5))
        n1, n2 = round(8 * scale), round(3 * scale)  # 8..32 per 1-D family, 3..12 a side in 2-D
        families = [[(lo, cap, a_lb, inf) for lo, cap in _grid(w_lb, y_top, n1)]]
        if not first:
            families.append([(w_lb, inf, lo, cap) for lo, cap in _grid(a_lb, r_top, n1)])
            families.append(
                [
                    (ylo, ycap, rlo, rcap)
                    for ylo, ycap in _grid(w_lb, y_top, n2)
                    for rlo, rcap in _grid(a_lb, r_top, n2)
                    if ylo * (m - 1) + rlo + sum_lb <= U + slack
                ]
            )
        tables: list[list[tuple[float, float, float, float, _Table, _Table]]] = []
        for family in families:
            tables.append([])
            for ylo, ycap, rlo, rcap in family:
                F, G, path = _sweeps(c, layers, ycap, rcap)
                if path is not None and c.objective(path) < U:
                    U, inc = c.objective(path), path
                tables[-1].append((ylo, ycap, rlo, rcap, F, G))
        root = max(
            min(G[0].get(0, inf) + (m - 1) * ylo + rlo for ylo, _, rlo, _, _, G in t)
            for t in tables
        )
        limit = U + _TOL * max(1.0, abs(U))
        must = {(s, inc[s], inc[s + 1]) for s in range(S)}
        new: list[_Layer] = []
        for s in range(S):
            layer = {}
            for a, row in layers[s].items():
                cin, kept = c.cut(s - 1, a), []
                for b, w, cut, r in row:
                    y, lb = max(w, cut), -inf
                    for t in tables:
                        best = inf
                        for ylo, ycap, rlo, rcap, F, G in t:
                            fa, g = F[s].get(a), G[s + 1].get(b)
                            if ycap >= y and rcap >= r and fa is not None and g is not None:
                                v = fa + w + cut + g + (m - 1) * max(ylo, y, cin) + max(rlo, r)
                                best = min(best, v)
                        lb = max(lb, best)
                    forced = (s, a, b) in must
                    if r < 0 and lb <= limit:  # first round: one open bucket with rlo = 0
                        r = c.r(s, a, b)
                        lb += r  # the bucket added max(0, -1.0) = 0 for it
                    if lb > limit and not forced:
                        continue
                    kept.append((b, w, cut, r if r >= 0 else c.r(s, a, b)))
                if kept:
                    layer[a] = kept
            new.append(layer)
        layers = new
        n_now = sum(len(row) for layer in layers for row in layer.values())
        if n_now == count and not first:
            break
        log.debug("prune round: %d segments, U %.6g, root %.6g", n_now, U, root)
        count, first = n_now, False
    return _Segments(_trim(c, layers), w_lb, a_lb, min(root, U), inc)


def _trim(c: _Costs, layers: list[_Layer]) -> list[_Layer]:
    """Drop segments no full placement passes through (dead ends left by a stopped prune)."""
    ends = {0}
    fwd: list[_Layer] = []
    for layer in layers:
        fwd.append({a: row for a, row in layer.items() if a in ends})
        ends = {seg[0] for row in fwd[-1].values() for seg in row}
    out: list[_Layer] = []
    live = {c.K}
    for layer in reversed(fwd):
        kept = {a: [seg for seg in row if seg[0] in live] for a, row in layer.items()}
        out.append({a: row for a, row in kept.items() if row})
        live = set(out[-1])
    return out[::-1]


# ---------------------------------------------------------------- the ILP

_Var = dict[tuple[int, int, int], pulp.LpVariable]


def _build_ilp(c: _Costs, segs: _Segments, start: Sequence[int]) -> tuple[pulp.LpProblem, _Var]:
    """The segment ILP of the module docstring, with `start` as initial values."""
    prob = pulp.LpProblem("partition", pulp.LpMinimize)
    # PuLP ≥ 3.3 owns variables through the problem (LpVariable() is deprecated there)
    new = getattr(prob, "add_variable", pulp.LpVariable)
    W = new("W", lowBound=segs.w_lb)
    A = new("A", lowBound=segs.a_lb)
    x: _Var = {}
    inflow: dict[tuple[int, int], list[pulp.LpVariable]] = {}
    objective = [(W, float(c.m - 1)), (A, 1.0)]
    for s, layer in enumerate(segs.layers):
        w_row, a_row = [(W, 1.0)], [(A, 1.0)]
        for a, row in layer.items():
            for b, w, cut, r in row:
                v = x[s, a, b] = new(f"x_{s}_{a}_{b}", cat=pulp.LpBinary)
                objective.append((v, w + cut))
                w_row.append((v, -max(w, cut)))
                a_row.append((v, -r))
                inflow.setdefault((s + 1, b), []).append(v)
        prob += pulp.LpAffineExpression(w_row) >= 0, f"W_{s}"
        prob += pulp.LpAffineExpression(a_row) >= 0, f"A_{s}"
    nodes = sorted(
        {(s, a) for s, layer in enumerate(segs.layers) for a in layer}
        | {node for node in inflow if node[0] < c.S}
    )
    for s, a in nodes:  # a node with only inflow (or outflow) gets 0 = its flow
        flow = [(x[s, a, seg[0]], 1.0) for seg in segs.layers[s].get(a, [])]
        flow += [(v, -1.0) for v in inflow.get((s, a), [])]
        prob += pulp.LpAffineExpression(flow) == (1 if s == 0 else 0), f"flow_{s}_{a}"
    prob.setObjective(pulp.LpAffineExpression(objective))
    for v in x.values():
        v.setInitialValue(0)
    for s in range(c.S):
        x[s, start[s], start[s + 1]].setInitialValue(1)
    works, cuts, syncs = c.values(start)
    W.setInitialValue(max([*works, *cuts]))
    A.setInitialValue(max(syncs))
    return prob, x


@dataclass(frozen=True)
class _Outcome:
    proven: bool  # the solver proved optimality (within _MIP_REL_GAP)
    limited: bool  # its time limit stopped it
    has_solution: bool
    bound: float | None  # the solver's own dual bound
    detail: str  # the solver's words


class _HiGHS(pulp.HiGHS):
    """PuLP's HiGHS through highspy, plus the initial solution PuLP 3.3 drops."""

    def callSolver(self, lp: pulp.LpProblem) -> None:
        import highspy

        cols = sorted(lp.variables(), key=lambda v: v.index)
        start = highspy.HighsSolution()
        start.col_value = [v.varValue if v.varValue is not None else 0.0 for v in cols]
        start.value_valid = True
        lp.solverModel.setSolution(start)
        if self.threads is not None:
            # HiGHS keeps one thread pool per process and refuses a run asking for a
            # different size; rebuild it (blocking) so each call gets its threads.
            highspy.Highs.resetGlobalScheduler(True)
        lp.solverModel.run()

    def findSolutionValues(self, lp: pulp.LpProblem) -> tuple[int, int]:
        try:
            return super().findSolutionValues(lp)
        except KeyError:  # a model status PuLP 3.3 does not map (solution/memory limit)
            return pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound


_BANNER_DONE = False


def _silence_highs_banner() -> None:
    """highspy prints its banner to fd 1 on the first ``Highs()`` of a process
    (before any option can turn output off); swallow that one print."""
    global _BANNER_DONE
    if _BANNER_DONE:
        return
    _BANNER_DONE = True
    import sys

    import highspy

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 1)
            highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _run_highs(prob: pulp.LpProblem, time_limit: float | None, threads: int | None) -> _Outcome:
    _silence_highs_banner()
    import highspy

    kw = {"random_seed": 0, "mip_abs_gap": 1e-9}
    prob.solve(_HiGHS(msg=False, gapRel=_MIP_REL_GAP, timeLimit=time_limit, threads=threads, **kw))
    h = prob.solverModel
    status = h.getModelStatus()
    info = h.getInfo()
    has = info.primal_solution_status == highspy.SolutionStatus.kSolutionStatusFeasible
    bound = info.mip_dual_bound if math.isfinite(info.mip_dual_bound) else None
    return _Outcome(
        proven=status == highspy.HighsModelStatus.kOptimal and prob.status == pulp.LpStatusOptimal,
        limited=status == highspy.HighsModelStatus.kTimeLimit,
        has_solution=has and prob.status == pulp.LpStatusOptimal,
        bound=bound,
        detail=f"HiGHS: {h.modelStatusToString(status)} (its gap {info.mip_gap:.3g}, "
        f"bound {info.mip_dual_bound:.8g}; PuLP: {pulp.LpStatus[prob.status]})",
    )


def _cbc(**kw: object) -> pulp.LpSolver:
    with warnings.catch_warnings():
        # PuLP 3.3 deprecates its bundled CBC for PuLP 4; it is the CBC most installs have.
        warnings.simplefilter("ignore", DeprecationWarning)
        for make in (pulp.PULP_CBC_CMD, pulp.COIN_CMD):
            solver = make(**kw)
            if solver.available():
                return solver
    raise SolverUnavailable(
        "CBC is not available to PuLP: PuLP ≤ 3 bundles it; otherwise install it "
        "(`pip install 'pulp[cbc]'`, or the coinor-cbc OS package), or use solver='highs' "
        "(`pip install highspy`)"
    )


def _run_cbc(prob: pulp.LpProblem, time_limit: float | None, threads: int | None) -> _Outcome:
    with tempfile.TemporaryDirectory() as tmp:
        log_path = os.path.join(tmp, "cbc.log")
        solver = _cbc(
            msg=False,
            timeLimit=time_limit,
            gapRel=_MIP_REL_GAP,
            threads=threads,
            warmStart=True,
            logPath=log_path,
        )
        prob.solve(solver)
        with open(log_path) as f:
            text = f.read()
    # CBC ends its log with "Result - Optimal solution found" or "Result - Stopped on
    # time limit", then "Objective value:", and when stopped "Lower bound:" / "Gap:".
    result = re.search(r"^Result - (.*)$", text, re.M)
    lower = re.search(r"^Lower bound:\s*(\S+)", text, re.M)
    gap = re.search(r"^Gap:\s*(\S+)", text, re.M)
    words = result.group(1).strip() if result else "no result line"
    proven = (
        words.startswith("Optimal solution found")
        and prob.status == pulp.LpStatusOptimal
        and prob.sol_status == pulp.LpSolutionOptimal
    )
    bound = None
    if lower:
        with contextlib.suppress(ValueError):
            bound = float(lower.group(1))
    return _Outcome(
        proven=proven,
        limited="Stopped on time" in words or "Stopped on time" in text,
        has_solution=prob.status == pulp.LpStatusOptimal
        and prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible),
        bound=bound,
        detail=f"CBC: {words} ("
        + (f"its gap {gap.group(1)}, bound {lower.group(1)}; " if gap and lower else "")
        + f"PuLP: {pulp.LpStatus[prob.status]})",
    )


def _pick_solver(name: str) -> str:
    if name not in SOLVERS:
        raise ValueError(f"solver must be one of {', '.join(map(repr, SOLVERS))} (got {name!r})")
    highs = pulp.HiGHS(msg=False).available()
    if name == "highs" and not highs:
        raise SolverUnavailable(
            "HiGHS is not available to PuLP: install it with `pip install highspy`, "
            "or pass solver='cbc' (CBC ships with PuLP)"
        )
    if name == "cbc" or (name == "auto" and not highs):
        _cbc(msg=False)  # raises SolverUnavailable with the install hint
        return "cbc"
    return "highs"


def _chosen_path(c: _Costs, x: _Var) -> list[int] | None:
    chosen = {(s, a): b for (s, a, b), v in x.items() if (v.varValue or 0.0) > 0.5}
    idx = [0]
    for s in range(c.S):
        b = chosen.get((s, idx[-1]))
        if b is None:
            return None
        idx.append(b)
    return idx if idx[-1] == c.K else None


def solve_partition(
    problem: PartitionProblem,
    *,
    solver: str = "highs",
    time_limit_s: float | None = None,
    warm_start: Sequence[int] | None = None,
    threads: int | None = None,
) -> PartitionSolution:
    """The placement of least step time, proven optimal by the segment ILP.

    Example::

        sol = solve_partition(problem, time_limit_s=30)
        if sol.status != "optimal":
            print(f"best found {sol.objective}, within {sol.gap:.1%} of optimal")

    Args:
        problem: the chain, stages and costs.
        solver: "highs" (PuLP's highspy interface), "cbc" (PuLP's CBC), or
            "auto" (HiGHS when installed, else CBC).
        time_limit_s: wall seconds for the whole call; the solver gets what the
            heuristic and pruning leave. On expiry the best placement found so
            far comes back with status "time_limit" (or "heuristic") and a gap.
        warm_start: starts of a placement to begin from (it must fit memory);
            the heuristic's placement is used as well, the better one wins.
        threads: solver threads; None: the solver's default. (For HiGHS this
            rebuilds its process-wide thread pool: do not mix thread counts
            across concurrent solves.)

    Returns:
        A PartitionSolution; ``status`` says whether it is proven optimal.

    Raises:
        PartitionInfeasible: no placement fits memory or split points (the
            message names which, with the numbers).
        PartitionTimeout: the limit ran out before any placement was found
            (only possible without a warm start).
        SolverUnavailable: the solver is not installed (with an install hint).
        ValueError: unknown solver, bad limit/threads, malformed warm start.
    """
    t0 = time.perf_counter()
    name = _pick_solver(solver)
    if time_limit_s is not None and not time_limit_s > 0:
        raise ValueError(f"time_limit_s must be > 0 seconds or None (got {time_limit_s!r})")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be an integer ≥ 1 or None (got {threads!r})")
    deadline = t0 + time_limit_s if time_limit_s is not None else math.inf
    c = _Costs(problem)
    _check_feasible(c)

    incumbents = []
    if warm_start is not None:
        idx = c.indices(warm_start)
        for s in range(c.S):
            need = c.mem(s, idx[s], idx[s + 1])
            if need > c.cap[s]:
                raise ValueError(
                    f"warm_start puts {problem.block_label(c.pos[idx[s]], c.pos[idx[s + 1]])} "
                    f"on stage {s}: it needs {_fmt_bytes(need)} of {_fmt_bytes(c.cap[s])}"
                )
        incumbents.append(idx)
    found = _heuristic(c, deadline)
    if found is not None:
        incumbents.append(found)
    if not incumbents:
        raise PartitionTimeout(
            f"time_limit_s={time_limit_s} ran out after {time.perf_counter() - t0:.3f} s, "
            "before the heuristic found a placement: raise the limit or pass warm_start"
        )
    incumbent = min(incumbents, key=c.objective)
    segs = _prune(c, c.objective(incumbent), incumbent, deadline)
    incumbent = segs.incumbent  # the pruning's DP sweeps may have found a better one
    log.info(
        "partition: %d blocks on %d stages, %d segments survive pruning (root bound %.6g, "
        "incumbent %.6g)",
        c.n,
        c.S,
        segs.count,
        segs.root,
        c.objective(incumbent),
    )

    def result(
        idx: Sequence[int], status: Status, bound: float | None, detail: str
    ) -> PartitionSolution:
        works, cuts, syncs = c.values(idx)
        T = _step_time(c.m, works, cuts, syncs)
        bound = segs.root if bound is None else max(bound, segs.root)
        bound = min(bound, T)
        if status == "optimal":
            bound = max(bound, T - _MIP_REL_GAP * abs(T))
        elif T - bound <= _MIP_REL_GAP * abs(T):
            status = "optimal"  # our bounds prove it: see [Note: root bounds]
        return PartitionSolution(
            starts=c.starts(idx),
            objective=T,
            stage_work=tuple(works),
            cut_times=tuple(cuts),
            stage_sync=tuple(syncs),
            stage_memory=tuple(c.mem(s, idx[s], idx[s + 1]) for s in range(c.S)),
            status=status,
            gap=(T - bound) / T if T > 0 else 0.0,
            bound=bound,
            solver=name,
            solve_s=time.perf_counter() - t0,
            n_segments=segs.count,
            solver_status=detail,
        )

    prob, x = _build_ilp(c, segs, incumbent)
    remaining = deadline - time.perf_counter()
    if remaining <= 0:
        sol = result(incumbent, "time_limit", None, "time limit reached before the ILP ran")
        if sol.status == "time_limit":
            log.warning(
                "partition: time limit reached before the ILP ran; keeping the best placement "
                "of the heuristic and pruning (T = %.6g, within %.2f%% of the bound)",
                sol.objective,
                100 * (sol.gap or 0.0),
            )
        return sol
    limit = None if math.isinf(remaining) else remaining
    outcome = (_run_highs if name == "highs" else _run_cbc)(prob, limit, threads)
    log.info("partition: %s", outcome.detail)
    path = _chosen_path(c, x) if outcome.has_solution else None
    U = c.objective(incumbent)
    unproven: Status = "time_limit" if outcome.limited else "heuristic"
    if path is None or c.objective(path) > U + _TOL * max(1.0, abs(U)):
        if not outcome.limited:
            log.warning(
                "partition: %s, but no placement better than the incumbent came back; "
                "keeping the incumbent, not proven optimal by the solver",
                outcome.detail,
            )
        bound = None if outcome.proven else outcome.bound  # a proof that missed is no proof
        return result(incumbent, unproven, bound, outcome.detail)
    if outcome.proven:
        return result(path, "optimal", outcome.bound, outcome.detail)
    sol = result(path, unproven, outcome.bound, outcome.detail)
    log.warning(
        "partition: %s stopped after %.1f s before proving optimality (%s); "
        "keeping its best (T = %.6g, within %.2f%% of the bound)",
        name,
        sol.solve_s,
        outcome.detail,
        sol.objective,
        100 * (sol.gap or 0.0),
    )
    return sol
