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
                W ≥ W_lb,  A ≥ A_lb                                 see [Note: root bounds]

The segments form a layered DAG from (0, 0) to (S, K); a feasible x is a path
through it with one segment per stage, and the last stage's segments all end
at K. Because each stage picks exactly one segment, the aggregated rows
``W ≥ Σ y·x`` equal that segment's value: one row per stage instead of one per
segment, and a tighter LP relaxation.

Only the segments that can beat an incumbent become variables, and root bounds
give the solver (and the caller) a lower bound: see [Note: segment pruning] and
[Note: root bounds] in :mod:`planner.solve.prune`.

The parts: ``problem`` (the problem, the answer, the errors), ``costs``
(memoised costs, :func:`evaluate`), ``feasible`` (feasibility checks, the
heuristic), ``exact`` (an exact DP for tests), ``prune`` (segments and bounds),
``ilp`` (the PuLP model and the HiGHS / CBC runs); :func:`solve_partition`,
which ties them together, is here.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence

from planner.solve import prune as _pruning
from planner.solve.costs import _Costs, _step_time, evaluate
from planner.solve.exact import exact_partition
from planner.solve.feasible import _check_feasible, _heuristic, _tie_break, heuristic_partition
from planner.solve.ilp import (
    _MIP_REL_GAP,
    SOLVERS,
    _build_ilp,
    _chosen_path,
    _pick_solver,
    _run_cbc,
    _run_highs,
)
from planner.solve.problem import CutFn as CutFn
from planner.solve.problem import (
    PartitionInfeasible,
    PartitionProblem,
    PartitionSolution,
    PartitionTimeout,
    SolverUnavailable,
    Status,
    _fmt_bytes,
)
from planner.solve.problem import SegFn as SegFn
from planner.solve.prune import _ROUNDS, _TOL, _Segments

__all__ = [
    "SOLVERS",
    "PartitionInfeasible",
    "PartitionProblem",
    "PartitionSolution",
    "PartitionTimeout",
    "SolverUnavailable",
    "check_solver",
    "evaluate",
    "exact_partition",
    "heuristic_partition",
    "solve_partition",
]

log = logging.getLogger(__name__)


# [Note: patchable solver knobs] The tests and bench/bench_solver.py set
# planner.solve._ROUNDS (fewer pruning rounds, so the ILP does the work); the bench
# also wraps planner.solve._run_highs / _run_cbc to time the solver. So _prune and
# solve_partition below look those three up here, in the package, at call time.


def _prune(c: _Costs, U: float, incumbent: Sequence[int], deadline: float = math.inf) -> _Segments:
    """The segments that can be in a placement with T ≤ U, in at most ``_ROUNDS`` rounds.

    :func:`planner.solve.prune._prune`, with the round limit read here: see
    [Note: patchable solver knobs].
    """
    return _pruning._prune(c, U, incumbent, deadline, rounds=_ROUNDS)


def check_solver(solver: str) -> str:
    """Which solver ``solver`` means here: "highs" or "cbc"; fails when it is not installed.

    Example::

        check_solver("auto")    # "highs" when highspy is installed, else "cbc"

    Raises:
        ValueError: an unknown solver name.
        SolverUnavailable: the solver is not installed; the message says how to install it.
    """
    return _pick_solver(solver)


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
        A PartitionSolution; ``status`` says whether it is proven optimal. Among
        placements of the same step time, the one with the earliest split points
        (see [Note: tie-breaking] in :mod:`planner.solve.feasible`).

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
        idx = _tie_break(c, list(idx))  # one answer among equal optima: [Note: tie-breaking]
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
            # PuLP does not raise on an infeasible, unbounded or undefined model: its
            # status was checked in _run_highs / _run_cbc, and no path means no answer.
            log.warning(
                "partition: %s, but no placement better than the incumbent came back "
                "(the incumbent meets every constraint: one contiguous run of blocks per "
                "stage, legal split points, memory per stage); keeping it, not proven "
                "optimal by the solver",
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
