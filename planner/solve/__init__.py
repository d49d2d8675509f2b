"""Place a chain of blocks on pipeline stages: the step solver, and the closed-form ILP.

The planner's placements come from the **step solver** (``step``,
``step_problem``, ``step_table``, ``step_ilp``): :func:`planner.solve.step.solve_step`
minimises the longest path of a step's graph, the number a plan prints (see
[Note: the step MILP]). It starts from the placement of the **closed-form
ILP** below, which minimises the flow-shop formula of a pipelined step: a fast,
good placement, but not the step's optimum (it ignores how stages overlap).

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

The parts: ``problem`` (the problem, the answer, the errors), ``segments``
(memoised segment costs, :func:`evaluate`), ``feasible`` (feasibility checks,
the heuristic), ``exact`` (an exact DP for tests), ``prune`` (segments and
bounds), ``ilp`` (the PuLP model and the HiGHS / CBC runs), ``partition``
(:func:`solve_partition`, which ties them together).

It imports nothing else of the planner. Names are loaded on first use, so that
``planner.solve.problem`` (the problem and the solver names) never loads PuLP.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "SOLVERS",
    "PartitionInfeasible",
    "PartitionProblem",
    "PartitionSolution",
    "PartitionTimeout",
    "SolverUnavailable",
    "StepProblem",
    "StepSolution",
    "check_solver",
    "evaluate",
    "exact_partition",
    "heuristic_partition",
    "solve_partition",
    "solve_step",
]

_WHERE = {
    "SOLVERS": "problem",
    "PartitionInfeasible": "problem",
    "PartitionProblem": "problem",
    "PartitionSolution": "problem",
    "PartitionTimeout": "problem",
    "SolverUnavailable": "problem",
    "StepProblem": "step_problem",
    "StepSolution": "step_problem",
    "check_solver": "partition",
    "evaluate": "segments",
    "exact_partition": "exact",
    "heuristic_partition": "feasible",
    "solve_partition": "partition",
    "solve_step": "step",
}

if TYPE_CHECKING:
    from planner.solve.exact import exact_partition
    from planner.solve.feasible import heuristic_partition
    from planner.solve.partition import check_solver, solve_partition
    from planner.solve.problem import (
        SOLVERS,
        PartitionInfeasible,
        PartitionProblem,
        PartitionSolution,
        PartitionTimeout,
        SolverUnavailable,
    )
    from planner.solve.segments import evaluate
    from planner.solve.step import solve_step
    from planner.solve.step_problem import StepProblem, StepSolution


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"planner.solve.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'planner.solve' has no attribute {name!r}")
