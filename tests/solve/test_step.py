"""The step solver on its own: random graphs against brute force, bounds, limits and errors."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import time

import pytest

from planner.solve import PartitionInfeasible
from planner.solve import step as step_module
from planner.solve.step import solve_step
from planner.solve.step_problem import GraphNode, Row, StepProblem
from planner.solve.step_table import StepTable

REL = 1e-9


def _problem(seed: int, *, exact: bool = True, memory: bool = False) -> StepProblem:
    """A random DAG over S stages' (work, tail) figures and the links' figure; with
    ``exact=False`` the step is 10 % slower than the graph on uneven placements."""
    rng = random.Random(seed)
    n, S = rng.randint(4, 10), rng.randint(2, 4)
    S = min(S, n)
    work = [rng.uniform(0.1, 3) for _ in range(n)]
    tail = [rng.uniform(0, 1) for _ in range(n)]
    link = [rng.uniform(0, 1) for _ in range(n + 1)]
    nodes: list[GraphNode] = []
    for s in range(S):  # a chain of computes, each stage twice (a two-micro-batch pipeline)
        for k in range(2):
            preds = tuple(
                v for v in (len(nodes) - 1, len(nodes) - 2) if v >= 0 and rng.random() < 0.8
            )
            cut = ((s - 1, 0, 1.0),) if s and k == 0 else ()
            nodes.append(GraphNode(preds=preds, seg=((s, 0, 1.0),), cut=cut))
    ends = []
    for s in range(S):
        nodes.append(GraphNode(preds=(2 * s + 1,), seg=((s, 1, 1.0),)))
        ends.append(len(nodes) - 1)
    cap = [2.5 if memory else math.inf] * S

    def figures(s: int, i: int, j: int) -> tuple[float, float]:
        return sum(work[i:j]), max(tail[i:j])

    table: dict[str, StepTable] = {}

    def evaluate(starts: tuple[int, ...]) -> float:
        t = table["t"]
        graph = t.graph_times(t.indices(starts))[0]
        if exact:
            return graph
        sizes = [b - a for a, b in itertools.pairwise([*starts, n])]
        return graph * (1.1 if max(sizes) - min(sizes) > 1 else 1.0)

    p = StepProblem(
        n_blocks=n,
        n_stages=S,
        seg_figures=figures,
        cut_figures=lambda s, j: (link[j],),
        seg_memory=lambda s, i, j: sum(work[i:j]),
        capacity=cap,
        nodes=nodes,
        ends=ends,
        evaluate=evaluate,
        exact=exact,
        rows=(Row(seg=tuple((s, 0, 0.5) for s in range(S))),),
    )
    table["t"] = StepTable(p)
    return p


def _brute(p: StepProblem) -> float | None:
    best = None
    for cuts in itertools.combinations(range(1, p.n_blocks), p.n_stages - 1):
        starts = (0, *cuts)
        bounds = [*starts, p.n_blocks]
        mem = [p.seg_memory(s, bounds[s], bounds[s + 1]) for s in range(p.n_stages)]
        if any(mem[s] > p.capacity[s] for s in range(p.n_stages)):
            continue
        if any(sum(mem[s] for s in g) > p.capacity[g[0]] for g in p.shared):
            continue
        t = p.evaluate(starts)
        best = t if best is None or t < best else best
    return best


@pytest.mark.parametrize(("enumerate_max", "solver"), [(0, "highs"), (0, "cbc"), (10**6, "highs")])
def test_exact_problems_are_solved_to_the_brute_force_optimum(
    enumerate_max: int, solver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(step_module, "ENUMERATE_MAX", enumerate_max)
    for seed in range(30):
        p = _problem(seed, memory=seed % 3 == 0)
        best = _brute(p)
        if best is None:
            with pytest.raises(PartitionInfeasible):
                solve_step(p, solver=solver)
            continue
        sol = solve_step(p, solver=solver)
        assert sol.status == "optimal"
        assert sol.method == ("milp" if enumerate_max == 0 else "enumeration")
        assert sol.step == pytest.approx(best, rel=REL)
        assert sol.step == pytest.approx(p.evaluate(sol.starts), rel=REL)
        assert best * (1 - 1e-6) <= sol.bound <= best * (1 + REL)


@pytest.mark.parametrize("solver", ["highs", "cbc"])
def test_a_ceiling_asks_only_for_a_placement_below_it(
    solver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Warm-started at the worst placement, with a ceiling between the optimum and it: the
    MILP (CBC's lean options included) finds the optimum; with the ceiling below the
    optimum, the answer is the incumbent, bounded at the ceiling, proven by the MILP."""
    monkeypatch.setattr(step_module, "ENUMERATE_MAX", 0)
    checked = 0
    for seed in range(40):
        p = _problem(seed)
        steps = {
            (0, *c): p.evaluate((0, *c))
            for c in itertools.combinations(range(1, p.n_blocks), p.n_stages - 1)
        }
        best, (worst, top) = min(steps.values()), max(steps.items(), key=lambda kv: kv[1])
        if top < best * 1.05:
            continue
        between = (best + top) / 2
        sol = solve_step(p, solver=solver, warm_starts=[worst], ceiling=between)
        if sol.method != "milp":  # the segment bounds decided it
            continue
        assert sol.status == "optimal"
        assert sol.step == pytest.approx(best, rel=REL)
        below = solve_step(p, solver=solver, warm_starts=[worst], ceiling=best * 0.99)
        assert below.status == "bounded"
        assert below.step == pytest.approx(top, rel=REL)
        assert below.bound == pytest.approx(best * 0.99, rel=REL)
        checked += 1
    assert checked >= 5


@pytest.mark.parametrize("enumerate_max", [0, 10**6])
def test_stages_sharing_a_device_fit_it_together(
    enumerate_max: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several stages per rank: stage s on device s mod 2, their memory summed (brute force).
    Tight capacities make the unshared optimum unfit in some seeds, and none fit in others."""
    monkeypatch.setattr(step_module, "ENUMERATE_MAX", enumerate_max)
    differs = refused = 0
    for seed in range(40):
        base = _problem(seed)
        S = base.n_stages
        if S < 3:
            continue
        groups = tuple(tuple(range(k, S, 2)) for k in range(2))
        total = base.seg_memory(0, 0, base.n_blocks)
        cap = total * (0.5 + 0.05 * (seed % 5))  # 0.50 … 0.70 of the whole chain per device
        shared = dataclasses.replace(base, shared=groups, capacity=[cap] * S)
        alone = dataclasses.replace(base, capacity=[cap] * S)
        best, free = _brute(shared), _brute(alone)
        if best is None:
            refused += 1
            with pytest.raises(PartitionInfeasible, match="together"):
                solve_step(shared)
            continue
        sol = solve_step(shared)
        assert sol.status == "optimal"
        assert sol.step == pytest.approx(best, rel=REL)
        assert StepTable(shared).fits_all(StepTable(shared).indices(sol.starts))
        differs += free is not None and best > free * (1 + 1e-9)
    assert differs >= 1 and refused >= 1  # both cases met


def test_bounded_problems_never_claim_more_than_they_prove(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step_module, "ENUMERATE_MAX", 0)
    monkeypatch.setattr(step_module, "ENUMERATE_WORK", 0)
    monkeypatch.setattr(step_module, "PROVE_WORK", 0)
    seen = set()
    for seed in range(30):
        p = _problem(seed, exact=False)
        best = _brute(p)
        assert best is not None
        sol = solve_step(p)
        seen.add(sol.status)
        assert sol.bound <= best * (1 + REL), (seed, sol)
        assert sol.step >= best * (1 - REL)
        assert sol.gap == pytest.approx((sol.step - sol.bound) / sol.step)
        if sol.status == "optimal":
            assert sol.step == pytest.approx(best, rel=REL)
    assert "optimal" in seen


def test_few_rounds_leave_the_gap_open_and_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step_module, "ENUMERATE_MAX", 0)
    monkeypatch.setattr(step_module, "ENUMERATE_WORK", 0)
    monkeypatch.setattr(step_module, "PROVE_WORK", 0)
    monkeypatch.setattr(step_module, "GAP_ROUNDS", 0)
    monkeypatch.setattr(step_module, "POLISH_BUDGET", 0)
    statuses = {solve_step(_problem(seed, exact=False)).status for seed in range(30)}
    assert "bounded" in statuses


def test_no_milp_starts_without_the_time_to_run_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A solver's own limit counts from its start (CBC read a big model for minutes past
    -sec 0.01): with less than MILP_MIN_S left, the answer is the bounds' floor."""
    monkeypatch.setattr(step_module, "ENUMERATE_MAX", 0)
    monkeypatch.setattr(step_module, "MILP_MIN_S", 1e9)  # never time enough
    statuses = set()
    for seed in range(30):
        p = _problem(seed)
        best = _brute(p)
        if best is None:
            continue
        sol = solve_step(p, time_limit_s=60)
        statuses.add(sol.status)
        assert sol.method == "bounds" and sol.solver_s == 0.0, sol
        assert sol.bound <= best * (1 + REL) and sol.step >= best * (1 - REL)
        if sol.status != "optimal":
            assert sol.status == "time_limit" and "before the MILP" in sol.detail
    assert "time_limit" in statuses


def test_a_milp_too_large_for_the_time_left_is_not_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An exact problem's step MILP is built only where the time left covers its size
    (MILP_SIZE_PER_S); else the segment bounds' gap stands, said so, and without a limit
    it is always built."""
    monkeypatch.setattr(step_module, "ENUMERATE_MAX", 0)
    gated = built = 0
    for seed in range(30):
        p = _problem(seed)
        best = _brute(p)
        if best is None:
            continue
        monkeypatch.setattr(step_module, "MILP_SIZE_PER_S", 1e-3)  # nothing is small enough
        sol = solve_step(p, time_limit_s=60)
        assert sol.method == "bounds" and sol.solver_s == 0.0, sol
        assert sol.bound <= best * (1 + REL) and sol.step >= best * (1 - REL)
        if sol.status != "optimal":
            assert sol.status == "bounded" and "too large" in sol.detail, sol
            assert f"{sol.n_segments} candidate stages × {len(p.nodes)} graph nodes" in sol.detail
            gated += 1
            unlimited = solve_step(p)  # no limit: always built
            assert unlimited.method == "milp" and unlimited.status == "optimal"
            assert unlimited.step == pytest.approx(best, rel=REL)
            monkeypatch.setattr(step_module, "MILP_SIZE_PER_S", 1e9)
            roomy = solve_step(p, time_limit_s=60)
            assert roomy.method == "milp" and roomy.status == "optimal"
            built += 1
    assert gated > 0 and built == gated


def test_warm_starts_are_checked_and_memory_is_kept() -> None:
    p = _problem(3, memory=True)
    t = StepTable(p)
    with pytest.raises(ValueError, match="starts must"):
        solve_step(p, warm_starts=[(1, 2)])
    sol = solve_step(p, warm_starts=[(0, *range(1, p.n_stages))])
    assert t.fits_all(t.indices(sol.starts))
    with pytest.raises(ValueError, match="time_limit_s"):
        solve_step(p, time_limit_s=0)


def test_an_exact_problem_whose_step_disagrees_with_its_graph_is_a_bug(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import dataclasses

    monkeypatch.setattr(step_module, "ENUMERATE_MAX", 0)
    p = _problem(4)
    wrong = dataclasses.replace(p, evaluate=lambda starts: p.evaluate(starts) + 1.0)
    with pytest.raises(AssertionError, match="exact=True"):
        solve_step(wrong)


def test_problems_are_validated() -> None:
    p = _problem(1)
    import dataclasses

    with pytest.raises(ValueError, match="nodes must come in order"):
        dataclasses.replace(p, nodes=[GraphNode(preds=(0,))])
    with pytest.raises(ValueError, match="ends must name nodes"):
        dataclasses.replace(p, ends=[len(p.nodes)])
    with pytest.raises(ValueError, match="capacity"):
        dataclasses.replace(p, capacity=[1.0])


def test_a_slow_machine_solves_bounded_problems_the_same_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whether a bounded problem is enumerated, searched or bounded is counted, not timed:
    evaluations 2 ms slower give the same placements, statuses and counts."""
    monkeypatch.setattr(step_module, "ENUMERATE_WORK", 400)  # some enumerate, some do not
    monkeypatch.setattr(step_module, "PROVE_WORK", 400)
    problems = [_problem(seed, exact=False) for seed in range(8)]

    def answers(delay_s: float) -> list[tuple[object, ...]]:
        out = []
        for p in problems:
            fast = p.evaluate

            def slow(starts: tuple[int, ...], fast=fast) -> float:
                time.sleep(delay_s)
                return fast(starts)

            q = dataclasses.replace(p, evaluate=slow)
            for prove in (True, False):
                s = solve_step(q, prove=prove, warm_starts=[tuple(range(p.n_stages))])
                out.append((s.starts, s.status, s.method, s.evaluated, round(s.bound, 9)))
        return out

    fast, slow = answers(0.0), answers(0.002)
    assert fast == slow
    assert {a[2] for a in fast} >= {"enumeration", "search"}


def test_a_bounded_problem_to_be_proven_is_enumerated_further(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``prove=True`` affords ``PROVE_WORK``: the kept configuration is proven outright where
    a searched one is not."""
    monkeypatch.setattr(step_module, "ENUMERATE_MAX", 0)
    monkeypatch.setattr(step_module, "ENUMERATE_WORK", 0)
    for seed in range(10):
        p = _problem(seed, exact=False)
        warm = [tuple(range(p.n_stages))]
        proven = solve_step(p, warm_starts=warm)
        assert (proven.status, proven.method) == ("optimal", "enumeration")
        assert proven.step == pytest.approx(_brute(p), rel=REL)
        searched = solve_step(p, warm_starts=warm, prove=False)
        assert (searched.method, searched.bound) == ("search", 0.0)
