"""The segment ILP in PuLP, and running it on HiGHS or CBC: limits, bounds and gaps."""

from __future__ import annotations

import contextlib
import math
import os
import re
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import pulp

from planner.solve.problem import SOLVERS, SolverUnavailable
from planner.solve.prune import Segments
from planner.solve.segments import SegmentCosts

__all__ = [
    "CBC_LEAN",
    "MILP_MIN_S",
    "MIP_REL_GAP",
    "HighsSolver",
    "Outcome",
    "build_ilp",
    "chosen_path",
    "pick_solver",
    "run_cbc",
    "run_highs",
]

MIP_REL_GAP = 1e-7  # "optimal" means proven within this relative gap
MILP_MIN_S = 1.0
"""Seconds left at least to build and start a MILP: a solver's limit counts from its start
(CBC given 0.01 s read and preprocessed a 67 MB step MILP for over 4 minutes)."""

_Var = dict[tuple[int, int, int], pulp.LpVariable]


def build_ilp(c: SegmentCosts, segs: Segments, start: Sequence[int]) -> tuple[pulp.LpProblem, _Var]:
    """The segment ILP of the :mod:`planner.solve` docstring, with `start` as initial values."""
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
class Outcome:
    proven: bool  # the solver proved optimality (within MIP_REL_GAP)
    limited: bool  # its time limit stopped it
    has_solution: bool
    bound: float | None  # the solver's own dual bound
    detail: str  # the solver's words
    infeasible: bool = False  # the solver proved that no solution exists


class HighsSolver(pulp.HiGHS):
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


def run_highs(
    prob: pulp.LpProblem,
    time_limit: float | None,
    threads: int | None,
    lean: bool = False,
    node_limit: int | None = None,
) -> Outcome:
    """Solve with HiGHS.

    ``lean``: for a model that starts from a good incumbent, skip HiGHS's presolve
    and its sub-MIP heuristics. On the step MILP presolve probed the binaries of its
    dense figure rows for 2.9 s where the solve took 0.1 s (gpt, 1 300 binaries), and
    RINS / RENS sub-MIPs took 3.1 of 3.4 s (a 24-layer GPT on 8 stages, 248 binaries;
    0.34 s without them), both to the same optimum. ``node_limit``: stop after that
    many branch-and-bound nodes (a count, so the same model stops at the same place);
    the dual bound is still a bound.
    """
    _silence_highs_banner()
    import highspy

    kw: dict[str, object] = {"random_seed": 0, "mip_abs_gap": 1e-9}
    if node_limit is not None:
        kw["mip_max_nodes"] = node_limit
    if lean:
        kw.update(
            presolve="off",
            mip_heuristic_effort=0.0,
            mip_heuristic_run_rins=False,
            mip_heuristic_run_rens=False,
            mip_heuristic_run_root_reduced_cost=False,
        )
    prob.solve(
        HighsSolver(msg=False, gapRel=MIP_REL_GAP, timeLimit=time_limit, threads=threads, **kw)
    )
    h = prob.solverModel
    status = h.getModelStatus()
    info = h.getInfo()
    has = info.primal_solution_status == highspy.SolutionStatus.kSolutionStatusFeasible
    bound = info.mip_dual_bound if math.isfinite(info.mip_dual_bound) else None
    return Outcome(
        proven=status == highspy.HighsModelStatus.kOptimal and prob.status == pulp.LpStatusOptimal,
        limited=status == highspy.HighsModelStatus.kTimeLimit,
        has_solution=has and prob.status == pulp.LpStatusOptimal,
        bound=bound,
        infeasible=status == highspy.HighsModelStatus.kInfeasible,
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
        "the ILP solver CBC is not available to PuLP (PuLP ≤ 3 bundles it; this PuLP does "
        "not, and no `cbc` is on the PATH).\n"
        "  why: the planner places blocks on stages by solving an ILP.\n"
        "  fix: install it (`pip install 'pulp[cbc]'`, or the coinor-cbc OS package), or use "
        "HiGHS instead (`pip install highspy`, then `--solver highs`)"
    )


CBC_LEAN = ("dualSimplex", "strongBranching 0", "heuristicsOnOff off", "preprocess off")
"""CBC's options for a model that starts from a good incumbent (``run_cbc(lean=True)``).

Measured on the four step MILPs of Llama 70B on 1024 H100s (4 574–17 009 columns,
8 345–32 965 rows, each warm-started at the search's placement), CBC 2.10.3, one
thread: 30, 13, 9 and 24 s with CBC's defaults; 5.3, 4.7, 6.4 and 7.8 s with these, to
the same optima. Where the time went: CBC's own choice of algorithm for the root LP
took 19.8 s on the largest, the dual simplex 5.3 s (``dualSimplex`` solves it first; the
time limit holds for it too); preprocessing and the feasibility pump, which re-find a
placement the warm start already gives, took 7–12 s after it; strong branching
doubled the nodes' time on the one whose warm start was not the optimum (0.5 % above).
"""


def run_cbc(
    prob: pulp.LpProblem, time_limit: float | None, threads: int | None, lean: bool = False
) -> Outcome:
    """Solve with CBC (PuLP's command-line CBC, its log parsed for the bound and gap).

    ``lean``: for a model that starts from a good incumbent, ``CBC_LEAN``'s options.
    """
    with tempfile.TemporaryDirectory() as tmp:
        log_path = os.path.join(tmp, "cbc.log")
        solver = _cbc(
            msg=False,
            timeLimit=time_limit,
            gapRel=MIP_REL_GAP,
            threads=threads,
            warmStart=True,
            logPath=log_path,
            options=list(CBC_LEAN) if lean else [],
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
    return Outcome(
        proven=proven,
        limited="Stopped on time" in words or "Stopped on time" in text,
        has_solution=prob.status == pulp.LpStatusOptimal
        and prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible),
        bound=bound,
        infeasible=prob.status == pulp.LpStatusInfeasible,
        detail=f"CBC: {words} ("
        + (f"its gap {gap.group(1)}, bound {lower.group(1)}; " if gap and lower else "")
        + f"PuLP: {pulp.LpStatus[prob.status]})",
    )


def pick_solver(name: str) -> str:
    """The solver to run for ``name`` ("auto": HiGHS when installed, else CBC).

    Raises:
        ValueError: an unknown name.
        SolverUnavailable: the solver is not installed (with the install command).
    """
    if name not in SOLVERS:
        raise ValueError(f"solver must be one of {', '.join(map(repr, SOLVERS))} (got {name!r})")
    highs = pulp.HiGHS(msg=False).available()
    if name == "highs" and not highs:
        raise SolverUnavailable(
            "the ILP solver HiGHS is not available to PuLP (its Python package highspy is "
            "missing or broken).\n"
            "  why: the planner places blocks on stages by solving an ILP, with HiGHS by default.\n"
            "  fix: install it (`pip install highspy`), or use CBC instead "
            "(`--solver cbc`, solver='cbc' from Python), which PuLP ≤ 3 bundles"
        )
    if name == "cbc" or (name == "auto" and not highs):
        _cbc(msg=False)  # raises SolverUnavailable with the install hint
        return "cbc"
    return "highs"


def chosen_path(n_stages: int, end: int, x: _Var) -> list[int] | None:
    """The placement (index form, ending at ``end``) that a solved MILP's segment
    binaries ``x[s, a, b]`` describe, or None."""
    chosen = {(s, a): b for (s, a, b), v in x.items() if (v.varValue or 0.0) > 0.5}
    idx = [0]
    for s in range(n_stages):
        b = chosen.get((s, idx[-1]))
        if b is None:
            return None
        idx.append(b)
    return idx if idx[-1] == end else None
