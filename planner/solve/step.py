"""``solve_step``: the placement of least step, and what is proven about it.

1. The warm starts (placements the caller found by other means) are
   evaluated; the best is the incumbent U.
   A bounded problem to be proven (``prove=True``) first polishes it: split
   points moved from its best placements and from seeded random ones.
2. Segments that do not fit their stage's memory, or whose bound exceeds U
   (the ``ceiling`` when that is lower: only a placement below it matters),
   are dropped (:class:`~planner.solve.step_table.StepTable`). When no
   placement is left under the ceiling, or the least over the placements of
   their largest segment bound reaches U, that proves it: no MILP is needed.
3. Few placements left: every one is evaluated (proven by enumeration;
   bounded problems allow more work, ``PROVE_WORK``, where they are to be
   proven). Otherwise the step MILP ([Note: the step MILP]) is solved, where the time
   left is enough for its size (``MILP_SIZE_PER_S``; else the bounds' gap stands).
4. An exact problem is then done: the MILP minimised the step itself. For a
   bounded one the MILP's optimum is a lower bound; its placement is polished
   too, and the MILP is solved again without the placements already evaluated
   (no-good rows), which raises the bound, for ``GAP_ROUNDS`` rounds (MILPs of
   at most ``ROUND_SEGMENTS`` candidate stages). Every budget is counted, so
   the same inputs give the same answer (the time limit aside). What is
   proven is reported as it stands.

Pure: numbers and callables in; it imports PuLP, never torch.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import pulp

from planner.solve.ilp import MILP_MIN_S, MIP_REL_GAP, Outcome, pick_solver, run_cbc, run_highs
from planner.solve.problem import PartitionInfeasible, PartitionTimeout
from planner.solve.step_budgets import (
    BOUND_NODES,
    ENUMERATE_MAX,
    ENUMERATE_WORK,
    GAP_ROUNDS,
    MILP_SIZE_PER_S,
    POLISH_BUDGET,
    PROVE_POLISH,
    PROVE_WORK,
    RESTARTS,
    ROUND_SEGMENTS,
    TIGHTEN_ROUNDS,
)
from planner.solve.step_ilp import build_step_ilp, chosen, milp_bound
from planner.solve.step_polish import polish
from planner.solve.step_problem import StepProblem, StepSolution, StepStatus
from planner.solve.step_table import Layers, StepTable

__all__ = ["solve_step"]

log = logging.getLogger(__name__)


def solve_step(
    problem: StepProblem,
    *,
    solver: str = "highs",
    time_limit_s: float | None = None,
    warm_starts: Iterable[Sequence[int]] = (),
    threads: int | None = None,
    prove: bool = True,
    ceiling: float | None = None,
) -> StepSolution:
    """The placement with the shortest step (``problem.evaluate``), and its proof.

    Example::

        sol = solve_step(problem, warm_starts=[(0, 5, 11)], time_limit_s=30)
        sol.status, sol.step, sol.bound   # "optimal", 12.5, 12.5

    Args:
        problem: the chain, the stages, the step's graph.
        solver: "highs", "cbc" or "auto" (HiGHS when installed).
        time_limit_s: wall seconds for the whole call.
        warm_starts: placements (starts) to begin from; those that do not fit
            memory are skipped.
        threads: MILP solver threads (None: the solver's default).
        prove: False: for a bounded problem with too many placements to evaluate
            them all, only search (polish the warm starts) and prove nothing
            (status "bounded", bound 0, method "search"): the MILP of a bounded
            problem costs seconds and yields a bound only, worth it for the one
            configuration a plan keeps. Exact problems are always proven.
        ceiling: a step reached already (another configuration's). For an
            exact problem whose incumbent is above it, the MILP asks only for a
            placement at or below it; when there is none, the answer is the
            incumbent with status "bounded" and bound = ``ceiling``: proven no
            faster than the step already reached, without the cost of its own
            optimum (a configuration that cannot win is not solved to the end).

    Raises:
        PartitionInfeasible: no placement fits the stages' memory.
        PartitionTimeout: the limit ran out before any placement was found.
        SolverUnavailable: the solver is not installed.
        ValueError: an unknown solver, a bad limit, a malformed warm start.
    """
    t0 = time.perf_counter()
    name = pick_solver(solver)
    if time_limit_s is not None and not time_limit_s > 0:
        raise ValueError(f"time_limit_s must be > 0 seconds or None (got {time_limit_s!r})")
    run = _Run(StepTable(problem), name, t0, t0 + (time_limit_s or math.inf), threads, prove)
    run.ceiling = ceiling
    starts = iter(warm_starts)
    run.offer_first(starts)  # the cheapest warm start (or why nothing fits)
    # Pruned against the ceiling only when the first warm start is not already below it.
    prunable = ceiling is not None and problem.exact and run.best is not None and ceiling < run.U
    if prunable and run.t.count(run.t.layers(ceiling or 0.0)) == 0:  # nothing reaches it
        run.pruned_at = ceiling  # answer with that placement
        note = f"no placement at or below {ceiling:.6g} ms (proven by the segment bounds)"
        return run.answer("bounded", ceiling or 0.0, "bounds", note)
    for ws in starts:
        idx = run.t.indices(ws)
        if run.t.fits_all(idx):
            run.offer(idx)
    total = math.comb(run.t.K - 1, run.t.S - 1)
    if not prove and not problem.exact and run.best and run.work(total) > ENUMERATE_WORK:
        run.polish(run.deadline)
        note = f"not proven: {run.evaluated} placements evaluated"
        return run.answer("bounded", 0.0, "search", note)
    if prove and not problem.exact and run.best:
        # The placement first, counted: a lower incumbent also prunes what is left to prove.
        run.polish_left = [PROVE_POLISH * max(POLISH_BUDGET, 6 * run.t.K)]
        run.polish(run.deadline, restarts=RESTARTS)
    return run.settle()


@dataclass
class _Run:
    """The state of one solve: the table, the incumbent, the clock."""

    t: StepTable
    solver: str
    t0: float
    deadline: float
    threads: int | None
    prove: bool = True
    best: list[int] | None = None
    U: float = math.inf
    evaluated: int = 0
    solver_s: float = 0.0
    n_segments: int = 0
    steps: dict[tuple[int, ...], float] = field(default_factory=dict)  # every one evaluated
    polish_left: list[int] | None = None
    ceiling: float | None = None
    pruned_at: float | None = None  # the layers hold only segments whose bound is ≤ this
    floor: float = 0.0  # the segment bounds' least bottleneck: no placement is below it

    def offer(self, idx: list[int]) -> float:
        """Evaluate a placement; keep it when it beats the incumbent."""
        key = tuple(idx)
        step = float(self.t.p.evaluate(self.t.starts(idx)))
        self.evaluated += 1
        self.steps[key] = step
        if step < self.U * (1 - 1e-12) or self.best is None:
            self.best, self.U = list(idx), step
        return step

    def settle(self) -> StepSolution:
        """After the warm starts: prune the segments by U (or the ceiling, when lower), and
        prove by the bounds, by enumeration or by the MILP."""
        p, c = self.t.p, self.ceiling
        beaten = c is not None and p.exact and bool(self.best) and c < self.U
        if beaten:  # only a placement at or below the ceiling matters: prune with it
            assert c is not None
            self.pruned_at = c
            layers = self.t.layers(c)
            if self.t.count(layers) == 0:
                note = f"no placement at or below {c:.6g} ms (proven by the segment bounds)"
                return self.answer("bounded", c, "bounds", note)
        else:
            layers = self.tightened(self.t.layers(self.U, keep=[self.best] if self.best else []))
        self.n_segments = sum(len(row) for layer in layers for row in layer.values())
        if self.t.count(layers) == 0:
            raise PartitionInfeasible(self.t.why_infeasible())
        low, _ = self.t.bottleneck(layers)
        self.floor = low
        if not beaten and low >= self.U * (1 - MIP_REL_GAP):
            note = f"the segment bounds reach the step: every placement is ≥ {low:.6g} ms"
            return self.answer("optimal", low, "bounds", note)
        if self.enumerable(layers):
            return self.enumerate(layers)
        return self.milp(layers)

    def tightened(self, layers: Layers) -> Layers:
        """Evaluate the placement at the layers' bottleneck bound (they rank placements
        well); while it beats U, prune again under it (``TIGHTEN_ROUNDS`` at most)."""
        for _ in range(TIGHTEN_ROUNDS):
            _, path = self.t.bottleneck(layers)
            if path is None or tuple(path) in self.steps or not self.t.fits_all(path):
                break
            before = self.U
            self.offer(path)
            if before <= self.U:
                break
            layers = self.t.layers(self.U, keep=[self.best] if self.best else [])
        return layers

    def offer_first(self, starts: Iterator[Sequence[int]]) -> None:
        """Evaluate the first of ``starts`` that fits memory (the rest are left); when the
        first of them does not fit, first make sure that some placement does."""
        for k, ws in enumerate(starts):
            idx = self.t.indices(ws)
            if self.t.fits_all(idx):
                self.offer(idx)
                return
            if k == 0 and self.best is None and self.t.count(self.t.layers(math.inf)) == 0:
                raise PartitionInfeasible(self.t.why_infeasible())  # before more warm starts

    def work(self, placements: int) -> int:
        """``placements`` evaluations, in the units of ``ENUMERATE_WORK``."""
        return placements * (len(self.t.p.nodes) + 16)

    def enumerable(self, layers: Layers) -> bool:
        count = self.t.count(layers)
        if count <= ENUMERATE_MAX:
            return True
        if self.t.p.exact:
            return False
        return self.work(count) <= (PROVE_WORK if self.prove else ENUMERATE_WORK)

    def answer(self, status: StepStatus, bound: float, method: str, detail: str) -> StepSolution:
        if self.best is None:
            raise PartitionTimeout(
                f"the time limit ran out after {time.perf_counter() - self.t0:.3f} s before "
                "any placement was found: raise the limit or give a warm start"
            )
        U = self.U
        bound = min(max(bound, self.floor), U)
        if status != "optimal" and U - bound <= MIP_REL_GAP * abs(U):
            status = "optimal"
        return StepSolution(
            starts=self.t.starts(self.best),
            step=U,
            bound=bound,
            gap=(U - bound) / U if U > 0 else 0.0,
            status=status,
            method=method,
            solver=self.solver,
            solve_s=time.perf_counter() - self.t0,
            solver_s=self.solver_s,
            n_segments=self.n_segments,
            evaluated=self.evaluated,
            detail=detail,
        )

    # ----------------------------------------------------------------- enumeration

    def enumerate(self, layers: Layers) -> StepSolution:
        """Evaluate every placement through the layers: the least is proven optimal."""
        count = self.t.count(layers)
        floor = math.inf if self.pruned_at is None else self.pruned_at  # the rest are above
        for idx in self.t.paths(layers, together=True):
            if tuple(idx) not in self.steps:
                self.offer(idx)
            if time.perf_counter() > self.deadline:
                bound = min(self._graph_bound(layers), floor)
                return self.answer(
                    "time_limit", bound, "enumeration", "time limit during enumeration"
                )
        if self.best is None:
            raise PartitionInfeasible(self.t.why_shared(next(self.t.paths(layers), None)))
        if floor < self.U:
            note = f"no placement at or below {floor:.6g} ms ({count} evaluated, the rest bounded)"
            return self.answer("bounded", floor, "enumeration", note)
        return self.answer("optimal", self.U, "enumeration", f"all {count} placements evaluated")

    def _graph_bound(self, layers: Layers) -> float:
        """The least graph value over the placements of ``layers`` (lower bounds all)."""
        return min((self.t.graph_times(idx)[0] for idx in self.t.paths(layers)), default=0.0)

    # ----------------------------------------------------------------- the MILP

    def solve_milp(self, prob: pulp.LpProblem) -> Outcome:
        remaining = self.deadline - time.perf_counter()
        limit = None if math.isinf(remaining) else max(remaining, 0.01)
        started = time.perf_counter()
        if self.solver == "highs":
            nodes = None if self.t.p.exact else BOUND_NODES
            outcome = run_highs(
                prob, limit, self.threads, lean=self.best is not None, node_limit=nodes
            )
        else:
            outcome = run_cbc(prob, limit, self.threads, lean=self.best is not None)
        self.solver_s += time.perf_counter() - started
        log.info("step MILP: %s", outcome.detail)
        return outcome

    def milp(self, layers: Layers) -> StepSolution:
        left = self.deadline - time.perf_counter()
        if left < MILP_MIN_S:  # the bounds' floor stands
            return self.answer("time_limit", self.floor, "bounds", "time limit before the MILP")
        size = self.n_segments * len(self.t.p.nodes)
        if self.t.p.exact and size > MILP_SIZE_PER_S * left:
            note = (
                f"the step MILP ({self.n_segments} candidate stages × {len(self.t.p.nodes)} "
                f"graph nodes) is too large to close the gap in the {left:.0f} s left "
                f"(MILP_SIZE_PER_S): not built"
            )
            return self.answer("bounded", self.floor, "bounds", note)
        c = self.ceiling
        ceiling = c if c is not None and self.t.p.exact and c < self.U else None
        start = None if self.pruned_at is not None else self.best  # not among the layers
        prob, x = build_step_ilp(self.t, layers, start, ceiling)
        outcome = self.solve_milp(prob)
        if ceiling is not None and outcome.infeasible:
            note = f"no placement at or below {ceiling:.6g} ms (proven; {outcome.detail})"
            return self.answer("bounded", ceiling, "milp", note)
        if outcome.infeasible and self.best is None:  # the devices' shared memory rows
            raise PartitionInfeasible(self.t.why_shared(None))
        path = chosen(self.t, x) if outcome.has_solution else None
        if path is not None and tuple(path) not in self.steps:
            step = self.offer(path)
            graph = self.t.graph_times(path)[0]
            if self.t.p.exact and abs(step - graph) > 1e-6 * max(1.0, abs(step)):
                raise AssertionError(
                    f"the step's graph gives {graph!r} for {self.t.starts(path)} but the step "
                    f"is {step!r}: the problem says exact=True, so they must agree"
                )
        bound = milp_bound(outcome, path, self.t)
        if self.t.p.exact:
            status: StepStatus = "optimal" if outcome.proven else "bounded"
            if outcome.limited:
                status = "time_limit"
            return self.answer(status, bound, "milp", outcome.detail)
        return self.close_gap(prob, x, layers, bound, outcome)

    def close_gap(
        self,
        prob: pulp.LpProblem,
        x: dict[tuple[int, int, int], pulp.LpVariable],
        layers: Layers,
        bound: float,
        outcome: Outcome,
    ) -> StepSolution:
        """Bounded problems: polish from the MILP's placement too, then raise the bound by
        no-goods (MILPs of at most ``ROUND_SEGMENTS`` candidate stages)."""
        # Counted, not timed (the time limit aside): the same inputs give the same plan.
        stop = self.deadline
        self.polish_left = [max(POLISH_BUDGET, 6 * self.t.K)]
        self.polish(stop)
        rounds, detail, limited = 0, outcome.detail, outcome.limited
        limit = GAP_ROUNDS if self.n_segments <= ROUND_SEGMENTS else 0
        last = chosen(self.t, x) if outcome.has_solution else None
        while (
            outcome.proven
            and last is not None
            and rounds < limit
            and bound < self.U * (1 - MIP_REL_GAP)
            and time.perf_counter() < stop - MILP_MIN_S
        ):
            rounds += 1
            S = self.t.S
            terms = [(x[s, last[s], last[s + 1]], 1.0) for s in range(S)]
            prob += pulp.LpAffineExpression(terms) <= S - 1, f"seen_{rounds}"
            outcome = self.solve_milp(prob)
            limited = outcome.limited
            last = chosen(self.t, x) if outcome.has_solution else None
            if not outcome.has_solution:  # every placement has been evaluated
                bound = self.U if outcome.proven or not outcome.limited else bound
                break
            if outcome.proven:
                bound = max(bound, min(self.U, milp_bound(outcome, last, self.t)))
            if last is not None and tuple(last) not in self.steps:
                self.offer(last)
                self.polish(stop)
            detail = outcome.detail
        status: StepStatus = "time_limit" if limited else "bounded"
        note = f"{detail}; {rounds} no-good round(s), {self.evaluated} placements evaluated"
        return self.answer(status, bound, "bound+simulation", note)

    def polish(self, stop: float, restarts: int = 0) -> None:
        """Local search from the best placements evaluated (:func:`polish`), on the
        solve's one budget (at least ``POLISH_BUDGET`` evaluations, 6 per block if more)."""
        if self.polish_left is None:  # one budget for the whole solve
            self.polish_left = [max(POLISH_BUDGET, 6 * self.t.K)]
        polish(self.t, self.steps, self.offer, self.polish_left, stop, restarts)
