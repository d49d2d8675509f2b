"""``solve_partition``: the heuristic, the pruning, then the ILP, and the answer's proof.

The formulation is in the package docstring (:mod:`planner.solve`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from planner.solve.feasible import check_feasible, heuristic, tie_break
from planner.solve.ilp import (
    MILP_MIN_S,
    MIP_REL_GAP,
    Outcome,
    build_ilp,
    chosen_path,
    pick_solver,
    run_cbc,
    run_highs,
)
from planner.solve.problem import (
    PartitionProblem,
    PartitionSolution,
    PartitionTimeout,
    Status,
    format_bytes,
)
from planner.solve.prune import PRUNE_ROUNDS, TOL, Segments, prune
from planner.solve.segments import SegmentCosts, step_time

__all__ = ["check_solver", "solve_partition"]

log = logging.getLogger(__name__)


def check_solver(solver: str) -> str:
    """Which solver ``solver`` means here: "highs" or "cbc"; fails when it is not installed.

    Example::

        check_solver("auto")    # "highs" when highspy is installed, else "cbc"

    Raises:
        ValueError: an unknown solver name.
        SolverUnavailable: the solver is not installed; the message says how to install it.
    """
    return pick_solver(solver)


def solve_partition(
    problem: PartitionProblem,
    *,
    solver: str = "highs",
    time_limit_s: float | None = None,
    warm_start: Sequence[int] | None = None,
    threads: int | None = None,
    prune_rounds: int = PRUNE_ROUNDS,
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
        prune_rounds: rounds of segment pruning at most before the ILP (fewer
            leave the ILP more to do).

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
    name = pick_solver(solver)
    _check_limits(time_limit_s, threads)
    deadline = t0 + time_limit_s if time_limit_s is not None else math.inf
    c = SegmentCosts(problem)
    check_feasible(c, reach=False)  # the rest: the heuristic finds a placement or raises
    first = _incumbent(c, warm_start, deadline, t0, time_limit_s)
    segs = prune(c, c.objective(first), first, deadline, rounds=prune_rounds)
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
    answer = _Answer(c, segs, name, t0)
    if deadline - time.perf_counter() < MILP_MIN_S:  # no time to build and run it
        return _out_of_time(answer, incumbent)
    prob, x = build_ilp(c, segs, incumbent)
    remaining = deadline - time.perf_counter()
    limit = None if math.isinf(remaining) else remaining
    started = time.perf_counter()
    outcome = (run_highs if name == "highs" else run_cbc)(prob, limit, threads)
    answer.solver_s = time.perf_counter() - started
    log.info("partition: %s", outcome.detail)
    path = chosen_path(c.S, c.K, x) if outcome.has_solution else None
    return _conclude(answer, c, outcome, path, incumbent)


def _check_limits(time_limit_s: float | None, threads: int | None) -> None:
    if time_limit_s is not None and not time_limit_s > 0:
        raise ValueError(f"time_limit_s must be > 0 seconds or None (got {time_limit_s!r})")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be an integer ≥ 1 or None (got {threads!r})")


def _out_of_time(answer: _Answer, incumbent: list[int]) -> PartitionSolution:
    """The limit ran out before the ILP: the heuristic's and the pruning's best, and its gap."""
    sol = answer(incumbent, "time_limit", None, "time limit reached before the ILP ran")
    if sol.status == "time_limit":
        log.warning(
            "partition: time limit reached before the ILP ran; keeping the best placement "
            "of the heuristic and pruning (T = %.6g, within %.2f%% of the bound)",
            sol.objective,
            100 * (sol.gap or 0.0),
        )
    return sol


def _incumbent(
    c: SegmentCosts,
    warm_start: Sequence[int] | None,
    deadline: float,
    t0: float,
    time_limit_s: float | None,
) -> list[int]:
    """The better of the warm start (checked against memory) and the heuristic's placement."""
    incumbents = []
    if warm_start is not None:
        idx = c.indices(warm_start)
        for s in range(c.S):
            need = c.mem(s, idx[s], idx[s + 1])
            if need > c.cap[s]:
                label = c.p.block_label(c.pos[idx[s]], c.pos[idx[s + 1]])
                raise ValueError(
                    f"warm_start puts {label} on stage {s}: it needs {format_bytes(need)} "
                    f"of {format_bytes(c.cap[s])}"
                )
        incumbents.append(idx)
    found = heuristic(c, deadline)
    if found is not None:
        incumbents.append(found)
    if not incumbents:
        raise PartitionTimeout(
            f"time_limit_s={time_limit_s} ran out after {time.perf_counter() - t0:.3f} s, "
            "before the heuristic found a placement: raise the limit or pass warm_start"
        )
    return min(incumbents, key=c.objective)


@dataclass
class _Answer:
    """Turns a placement, a status and a bound into the PartitionSolution returned."""

    c: SegmentCosts
    segs: Segments
    solver: str
    t0: float
    solver_s: float = 0.0

    def __call__(
        self, idx: Sequence[int], status: Status, bound: float | None, detail: str
    ) -> PartitionSolution:
        c = self.c
        idx = tie_break(c, list(idx))  # one answer among equal optima: [Note: tie-breaking]
        works, cuts, syncs = c.values(idx)
        T = step_time(c.m, works, cuts, syncs)
        bound = self.segs.root if bound is None else max(bound, self.segs.root)
        bound = min(bound, T)
        if status == "optimal":
            bound = max(bound, T - MIP_REL_GAP * abs(T))
        elif T - bound <= MIP_REL_GAP * abs(T):
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
            solver=self.solver,
            solve_s=time.perf_counter() - self.t0,
            solver_s=self.solver_s,
            n_segments=self.segs.count,
            solver_status=detail,
        )


def _conclude(
    answer: _Answer,
    c: SegmentCosts,
    outcome: Outcome,
    path: list[int] | None,
    incumbent: list[int],
) -> PartitionSolution:
    """The solver's placement when it is no worse than the incumbent, else the incumbent."""
    U = c.objective(incumbent)
    unproven: Status = "time_limit" if outcome.limited else "heuristic"
    if path is None or c.objective(path) > U + TOL * max(1.0, abs(U)):
        if not outcome.limited:
            # PuLP does not raise on an infeasible, unbounded or undefined model: its
            # status was checked in run_highs / run_cbc, and no path means no answer.
            log.warning(
                "partition: %s, but no placement better than the incumbent came back "
                "(the incumbent meets every constraint: one contiguous run of blocks per "
                "stage, legal split points, memory per stage); keeping it, not proven "
                "optimal by the solver",
                outcome.detail,
            )
        bound = None if outcome.proven else outcome.bound  # a proof that missed is no proof
        return answer(incumbent, unproven, bound, outcome.detail)
    if outcome.proven:
        return answer(path, "optimal", outcome.bound, outcome.detail)
    sol = answer(path, unproven, outcome.bound, outcome.detail)
    log.warning(
        "partition: %s stopped after %.1f s before proving optimality (%s); "
        "keeping its best (T = %.6g, within %.2f%% of the bound)",
        answer.solver,
        sol.solve_s,
        outcome.detail,
        sol.objective,
        100 * (sol.gap or 0.0),
    )
    return sol
