"""Bad-input cases 12-14: an ILP status that is not optimal, the solver's time limit, a solver
that is missing."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pulp
import pytest
from bad_input_kit import (
    A100,
    GIB,
    MLP,
    Env,
)

from planner.search.baselines import uniform
from planner.solve import (
    PartitionInfeasible,
    PartitionProblem,
    SolverUnavailable,
    check_solver,
    evaluate,
    solve_partition,
)
from planner.solve.ilp import HighsSolver
from planner.solve.step import solve_step
from planner.solve.step_problem import GraphNode, StepProblem

# --------------------------------------------------------------------------- 12, 13, 14. solver


def _step_chain(n: int, stages: int) -> StepProblem:
    """Stages that run side by side: the step is the busiest stage's work."""
    rng = random.Random(1)
    times = [rng.uniform(0.5, 2.0) for _ in range(n)]

    def step(starts: tuple[int, ...]) -> float:
        bounds = [*starts, n]
        return max(sum(times[a:b]) for a, b in itertools.pairwise(bounds))

    return StepProblem(
        n_blocks=n,
        n_stages=stages,
        seg_figures=lambda s, i, j: (sum(times[i:j]),),
        cut_figures=lambda s, j: (),
        seg_memory=lambda s, i, j: 0.0,
        capacity=[math.inf] * stages,
        nodes=[GraphNode(preds=(), seg=((s, 0, 1.0),)) for s in range(stages)],
        ends=tuple(range(stages)),
        evaluate=step,
    )


def _sync_heavy(n: int, stages: int) -> PartitionProblem:
    """Parameters unrelated to time: the all-reduce term fights the bottleneck."""
    rng = random.Random(0)
    times = [rng.lognormvariate(0, 1.0) for _ in range(n)]
    params = [10 * rng.lognormvariate(0, 1.5) for _ in range(n)]
    boundary = [rng.uniform(0, 3) for _ in range(n)]
    return PartitionProblem(
        n_blocks=n,
        n_stages=stages,
        micro_batches=2,
        seg_work=lambda s, i, j: sum(times[i:j]) + 0.3,
        seg_memory=lambda s, i, j: 0.0,
        capacity=[math.inf] * stages,
        cut_time=lambda s, j: boundary[j],
        seg_sync=lambda s, i, j: 0.1 * sum(params[i:j]),
    )


def _with_status(env: Env, gap: float, **changes: object) -> None:
    """Make every step solve of the search come back with ``changes`` (e.g. its status) and
    a bound ``gap`` below its step."""
    from planner.search import loop

    real = loop.solve_step

    def solve_and_mark(*args: object, **kwargs: object) -> object:
        sol = real(*args, **kwargs)  # type: ignore[arg-type]
        bound = sol.step * (1 - gap)
        return dataclasses.replace(sol, gap=gap, bound=bound, **changes)  # type: ignore[arg-type]

    env.monkeypatch.setattr(loop, "solve_step", solve_and_mark)


def test_case12_ilp_infeasible_unbounded_undefined(env: Env) -> None:
    # Infeasible problems are caught before the ILP, naming the constraint family.
    GiB = float(GIB)
    memory = PartitionProblem(
        n_blocks=3,
        n_stages=2,
        micro_batches=1,
        seg_work=lambda s, i, j: float(j - i),
        seg_memory=lambda s, i, j: (j - i) * GiB,
        capacity=[1.5 * GiB, 1.5 * GiB],
    )
    with pytest.raises(
        PartitionInfeasible,
        match=r"do not fit in the memory of 2 stages: .* leaves blocks 1\.\.2 for stage 1, "
        r"needing 2\.0 GiB against 1\.5 GiB\.\n  fix: use more stages",
    ):
        solve_partition(memory)
    splits = dataclasses.replace(memory, n_stages=3, capacity=[9 * GiB] * 3)
    splits = dataclasses.replace(splits, allowed_starts=frozenset({2}))
    with pytest.raises(
        PartitionInfeasible,
        match=r"stage 2 has no legal start: 3 stages need 2 split points, 1 allowed\.\n"
        r"  fix: use at most 2 stages",
    ):
        solve_partition(splits)
    # PuLP does not raise on a bad status: it is checked, and the ILP's values are not used.
    problem = _sync_heavy(20, 4)  # solved with weak pruning (one round): the ILP has work to do
    real = HighsSolver.findSolutionValues
    for status, solution in [
        (pulp.LpStatusInfeasible, pulp.LpSolutionInfeasible),
        (pulp.LpStatusUnbounded, pulp.LpSolutionUnbounded),
        (pulp.LpStatusUndefined, pulp.LpSolutionNoSolutionFound),
    ]:

        def said(self: HighsSolver, lp: pulp.LpProblem, st=status, so=solution) -> tuple[int, int]:
            real(self, lp)  # fills the variables: they must be ignored
            return st, so

        env.monkeypatch.setattr(HighsSolver, "findSolutionValues", said)
        sol = solve_partition(problem, prune_rounds=1)
        assert sol.status == "heuristic", pulp.LpStatus[status]
        assert f"PuLP: {pulp.LpStatus[status]}" in sol.solver_status
        assert sol.objective == pytest.approx(evaluate(problem, sol.starts))  # a real placement
        assert sol.gap is not None and sol.gap > 0
    # The step MILP's values are not used either: the placement stays the (poor) warm
    # start, and without a proof it says so, with HiGHS's own bound below its step.
    problem = _step_chain(12, 3)
    sol = solve_step(problem, warm_starts=[(0, 1, 2)])
    assert sol.status == "bounded" and sol.method == "milp", sol
    assert "PuLP: Undefined" in sol.detail
    assert sol.starts == (0, 1, 2) and 0 < sol.bound < sol.step and sol.gap > 0
    # End to end: the planner still writes a valid plan, the same as without the fault
    # (two stages: every placement is simulated, no MILP is needed).
    env.monkeypatch.undo()
    env.monkeypatch.setenv("PLANNER_CACHE_DIR", str(env.cache))
    model = env.write(MLP)
    clean, _ = env.planned(model, "--gpus", 2, *A100, "--pp", 2)
    env.monkeypatch.setattr(HighsSolver, "findSolutionValues", said)
    faulty, _ = env.planned(model, "--gpus", 2, *A100, "--pp", 2)
    assert faulty.split_points == clean.split_points
    assert faulty.predicted == clean.predicted
    # A placement the solver did not prove is recorded and reported as such.
    env.monkeypatch.undo()
    env.monkeypatch.setenv("PLANNER_CACHE_DIR", str(env.cache))
    _with_status(env, gap=0.1, status="bounded", method="milp", detail="HiGHS: (PuLP: Infeasible)")
    plan, out = env.planned(model, "--gpus", 2, *A100, "--pp", 2)
    assert plan.solver.status == "bounded" and plan.solver.gap == 0.1
    assert any(
        "the solver ended without proving the placement optimal (HiGHS: (PuLP: Infeasible)): "
        "its step"
        in w
        and "is proven within 10.00% of the best possible; try --solver cbc" in w
        for w in plan.warnings
    ), plan.warnings
    assert "step within 10.0 % of optimal for this configuration; none can be faster" in out
    assert "(no proof: HiGHS: (PuLP: Infeasible))" in out


def test_case13_solver_time_limit(env: Env) -> None:
    model = env.write(MLP)
    # No placement at all before the limit: an error, nothing written.
    err = env.refused(model, "--gpus", 2, *A100, "--time-limit", 1e-9)
    assert "no placement found in time: for every candidate" in err
    assert "the solver's time limit (1e-09 s per solve) ran out" in err
    assert "Fix: raise --time-limit (default 60 s)" in err
    # A limit hit with an incumbent: keep it, not proven optimal, with its gap.
    problem, start = _sync_heavy(20, 4), uniform(20, 4)
    sol = solve_partition(problem, time_limit_s=1e-4, warm_start=start)
    assert sol.status == "time_limit" and sol.gap is not None and sol.gap > 0
    assert sol.bound == pytest.approx(sol.objective * (1 - sol.gap))
    assert sol.objective <= evaluate(problem, start)
    # ... recorded in the plan and the report as such.
    _with_status(env, status="time_limit", gap=0.05)
    plan, out = env.planned(model, "--gpus", 2, *A100, "--pp", 2, "--time-limit", 30)
    assert plan.solver.status == "time_limit" and plan.solver.gap == 0.05
    assert plan.solver.time_limit_s == 30
    assert any(
        w.startswith(
            "the solver stopped at its time limit (30.0 s) before proving the placement "
            "optimal: its step"
        )
        and "is proven within 5.00% of the best possible" in w
        and "raise --time-limit" in w
        for w in plan.warnings
    ), plan.warnings
    assert "time limit: best found in 30 s, gap 5.0 %; none can be faster than" in out


def test_case13_a_milp_too_large_for_the_limit(env: Env) -> None:
    """The step MILP left unbuilt for its size: the plan keeps the bounds' gap and says how
    to get the MILP (a larger limit)."""
    model = env.write(MLP)
    detail = (
        "the step MILP (41382 candidate stages × 16320 graph nodes) is too large to close "
        "the gap in the 51 s left (MILP_SIZE_PER_S): not built"
    )
    _with_status(env, gap=0.02, status="bounded", method="bounds", detail=detail)
    plan, out = env.planned(model, "--gpus", 2, *A100, "--pp", 2)
    assert plan.solver.status == "bounded" and plan.solver.method == "bounds"
    assert any(
        "is proven within 2.00% of the best possible" in w
        and f"by the segment bounds, and {detail}; a larger --time-limit builds it" in w
        for w in plan.warnings
    ), plan.warnings
    flat = " ".join(out.split())  # the report folds long lines
    assert "step within 2.0 % of optimal for this configuration; none can be faster" in flat
    assert f"(no proof: {detail})" in flat


def test_case14_solver_missing(env: Env) -> None:
    model = env.write(MLP)
    env.monkeypatch.setattr(pulp.HiGHS, "available", lambda self: False)
    err = env.refused(model, "--gpus", 2, *A100)
    assert "the ILP solver HiGHS is not available to PuLP" in err
    assert "fix: install it (`pip install highspy`), or use CBC instead (`--solver cbc`" in err
    assert not env.cache.exists()  # refused before any profiling
    with pytest.raises(SolverUnavailable):
        check_solver("highs")
    assert check_solver("auto") == "cbc"
    for cls in (pulp.PULP_CBC_CMD, pulp.COIN_CMD):
        env.monkeypatch.setattr(cls, "available", lambda self: False)
    err = env.refused(model, "--gpus", 2, *A100, "--solver", "auto")
    assert "the ILP solver CBC is not available to PuLP" in err
    assert "`pip install 'pulp[cbc]'`" in err and "`pip install highspy`" in err
