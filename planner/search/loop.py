"""The search: every configuration, bounded, solved, simulated, ranked; the sturdiest near the
fastest wins.

For every configuration (pp, dp, m, schedule, v) and each way of laying it on
the cluster's ranks (:mod:`planner.search.configurations`):

1. a **lower bound** on its step time, from the work alone; a configuration
   whose bound cannot beat the best found so far is *pruned* without solving;
2. otherwise the blocks are placed: the closed-form ILP
   (:func:`~planner.solve.partition.solve_partition`) and the usual
   heuristics give placements to start from, and the step solver
   (:func:`~planner.solve.step.solve_step`) finds the placement whose
   *simulated* step is shortest, the number the plan prints, and proves it
   (or bounds it: [Note: shared cores]).

Configurations are visited in order of their bound, so the best is usually
found early and most others are pruned (against the best step plus the robust
band: [Note: robust band] in :mod:`planner.search.robust`). The ranked
candidates are kept with why each lost. Any of pp, dp, m, schedule, v can be pinned.

Activation recompute is chosen per stage inside the cost model: a stage
recomputes only when it would not fit otherwise.

Pure: no torch.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from planner.cost.basis import Layout
from planner.cost.model import CostModel, Prediction
from planner.devices.cluster import Cluster
from planner.options import SearchOptions, Training
from planner.plan.choice import ChoiceRecord
from planner.plan.schedule import stage_ranks
from planner.plan.sections import Candidate
from planner.plan.text import first_line
from planner.search import baselines
from planner.search.configurations import (
    Config,
    ProfileFor,
    ThreadsFor,
    bounded,
    configurations,
    local_cpu,
)
from planner.search.messages import best_note, fewer_processes, nothing_fits, plan_warnings
from planner.search.partition import closed_form_pays, partition_problem, step_problem
from planner.search.ranking import candidate, ranked
from planner.search.robust import (
    Sturdiness,
    choose,
    outranked,
    pruned_against,
    record,
    row_reason,
    sturdiness,
)
from planner.solve.partition import solve_partition
from planner.solve.problem import PartitionInfeasible, PartitionTimeout
from planner.solve.step import solve_step
from planner.solve.step_problem import StepSolution

if TYPE_CHECKING:
    from planner.plan.progress import Progress

__all__ = ["SearchResult", "place", "search"]

log = logging.getLogger(__name__)


@dataclass
class SearchResult:
    """The winner, and every candidate with its fate.

    Attributes:
        layout, cost: the chosen configuration and its cost model.
        solution: the step solver's answer for it (its placement, step, proof).
        prediction: the placement's predicted step (``solution.step``).
        candidates: what the plan records of the search (ranked).
        warnings: the chosen plan's performance hazards.
        choice: the robust band, and the fastest configuration when a sturdier
            one was chosen ([Note: robust band]).
    """

    layout: Layout
    solution: StepSolution
    prediction: Prediction
    cost: CostModel
    candidates: list[Candidate] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    choice: ChoiceRecord | None = None

    @property
    def starts(self) -> tuple[int, ...]:
        return self.solution.starts


def search(
    profile_for: ProfileFor,
    cluster: Cluster,
    training: Training,
    options: SearchOptions | None = None,
    *,
    allowed_starts: frozenset[int] | None = None,
    block_names: list[str] | None = None,
    n_blocks: int,
    threads_for: ThreadsFor | None = None,
    progress: Progress | None = None,
) -> SearchResult:
    """Find the configurations and placements with the shortest predicted steps, and keep the
    sturdiest within ``options.robust_band_pct`` of the fastest ([Note: robust band]).

    ``progress``: called as ``progress("searching N configurations", done, N, note)``
    before each configuration and once at the end (``done == N``), the note naming the
    best so far ("best pp 2 × dp 4, m 8, 1f1b: 12.3 ms"); see ``planner.report.progress``.

    ``threads_for``: on a local CPU cluster, the cluster and profiles at other torch
    thread counts ([Note: fewer CPU processes]); the winner's ``cost.cluster`` is then
    the processes it runs on, with their threads.

    Raises:
        ValueError: no configuration is possible (the message says why for the
            closest ones: memory per stage against capacity, batch divisibility,
            more stages than split points).
    """
    options = options or SearchOptions()
    configs = configurations(cluster, training, options, n_blocks, allowed_starts)
    tried: list[tuple[Config, Candidate]] = []
    solved: list[SearchResult] = []
    best_ms, grow = math.inf, 1 + options.robust_band_pct / 100
    oom_costs: list[CostModel] = []  # for the message when nothing fits
    laid = bounded(profile_for, cluster, training, configs, threads_for, options.dp_modes)
    laid = _scouted_first(laid, training, allowed_starts)
    # No step is below ``floor``; ``figures``: the solved ones', for ``outranked``.
    floor, figures = min((cfg.bound for cfg in laid), default=math.inf), list[Sturdiness]()
    phase = f"searching {len(laid)} configurations"
    for k, cfg in enumerate(laid):
        if progress is not None:
            progress(phase, k, len(laid), best_note(figures))
        top, against = best_ms * grow, pruned_against(best_ms, options)  # the band: solved
        if lost := _unsolved(cfg, top, against, figures, floor, options):
            tried.append((cfg, candidate(cfg, None, "pruned", lost)))
            continue
        cost = _cost_model(cfg, training)
        layout = cost.layout
        try:
            ceiling = top if math.isfinite(top) else None
            sol = place(
                cost, options, allowed_starts, block_names or (), prove=False, ceiling=ceiling
            )
        except PartitionInfeasible as exc:
            tried.append((cfg, candidate(cfg, None, "out_of_memory", first_line(exc))))
            oom_costs.append(cost)
            continue
        except PartitionTimeout as exc:
            tried.append((cfg, candidate(cfg, None, "timeout", first_line(exc))))
            continue
        if sol.step > top and sol.bound >= top:  # proven: cannot come within the band
            by = {"milp": "its MILP", "bounds": "its segment bounds"}.get(sol.method, sol.method)
            why = f"lower bound {sol.bound:.1f} ms ≥ {against} (proven by {by})"
            tried.append((cfg, candidate(cfg, None, "pruned", why)))
            continue
        pred = cost.predict(sol.starts)
        tried.append((cfg, candidate(cfg, pred.step_ms, "solved", "")))
        solved.append(SearchResult(layout=layout, solution=sol, prediction=pred, cost=cost))
        figures.append(_sturdy(solved[-1]))
        best_ms = min(best_ms, pred.step_ms)
    if not solved:
        records = [c for _, c in tried]
        raise ValueError(nothing_fits(records, oom_costs, cluster, training, options))
    single = local_cpu(cluster)  # [Note: fewer CPU processes]: say why it beat one process
    best = _chosen(solved, options, allowed_starts, tried, single)
    if progress is not None:
        progress(phase, len(laid), len(laid), best_note([_sturdy(best)]))
    best.warnings = plan_warnings(best.layout, best.solution, best.prediction, options)
    best.warnings += fewer_processes(best.cost.cluster, cluster)
    return best


def _chosen(
    solved: list[SearchResult],
    options: SearchOptions,
    allowed: frozenset[int] | None,
    tried: list[tuple[Config, Candidate]],
    single: bool,
) -> SearchResult:
    """The configuration kept, proven, with the choice and the ranked candidates: the
    fastest, proven, or the sturdiest within the band of it ([Note: robust band])."""
    k = min(range(len(solved)), key=lambda i: solved[i].prediction.step_ms)
    solved[k] = _proven(solved[k], options, allowed, tried)
    found = [_sturdy(r) for r in solved]
    verdict = choose(found, options)
    fastest = solved[verdict.fastest]  # the same step; the tie broken as the choice breaks it
    best = solved[verdict.chosen]
    if best is not fastest:
        best = _proven(best, options, allowed, tried)
        if best.prediction.step_ms <= fastest.prediction.step_ms:  # its proof found faster
            fastest = best
    kept, quick = _sturdy(best), _sturdy(fastest)
    best.choice = record(verdict, kept, quick, fastest.solution)
    best.candidates = ranked(
        [c for _, c in tried],
        best.layout,
        best.prediction.step_ms,
        options.keep,
        single=single,
        fastest_ms=fastest.prediction.step_ms,
        band_pct=options.robust_band_pct,
        why=None if fastest is best else row_reason(kept, quick, options),
    )
    return best


def _sturdy(r: SearchResult) -> Sturdiness:
    return sturdiness(r.layout, r.prediction)


def _unsolved(
    cfg: Config,
    top: float,
    against: str,
    figures: Sequence[Sturdiness],
    floor: float,
    options: SearchOptions,
) -> str | None:
    """Why ``cfg`` is pruned unsolved: its bound is above the band of the best (``top``), or
    it can be neither the fastest nor the one kept (``outranked``); None: it is solved."""
    if cfg.bound >= top:
        return f"lower bound {cfg.bound:.1f} ms ≥ {against}"
    return outranked((cfg.pp, cfg.virtual, cfg.dp_mode), cfg.bound, figures, floor, options)


def _scouted_first(
    laid: list[Config], training: Training, allowed: frozenset[int] | None
) -> list[Config]:
    """``laid`` (best bound first) with the configuration whose quick placements (uniform,
    time-balanced) simulate fastest moved to the front: solved first, its step is the
    ceiling every other configuration is pruned against, and the configuration with the
    least bound is often not the one that wins (a data-parallel step's all-reduce is not
    in the bound). Configurations whose bound is above the best quick step are not
    tried; order is all this changes (every configuration is still bounded or solved)."""
    best, first = math.inf, 0
    for k, cfg in enumerate(laid):
        if cfg.bound >= best:
            break
        cost = _cost_model(cfg, training)
        n, S = cost.n_blocks, cost.layout.n_stages
        works = [b.fwd_ms + b.bwd_ms for b in cost.profile.blocks]
        quick = (baselines.uniform(n, S, allowed), baselines.time_balanced(works, S, allowed))
        for starts in quick:
            if len(starts) != S or not cost.fits(starts):
                continue
            step = cost.step_ms(starts)
            if step < best:
                best, first = step, k
    return [laid[first], *laid[:first], *laid[first + 1 :]]


def _cost_model(cfg: Config, training: Training) -> CostModel:
    """The cost model of one laid configuration (profiles of each device type it uses)."""
    layout = Layout(
        pp=cfg.pp,
        dp=cfg.dp,
        micro_batches=cfg.m,
        schedule=cfg.schedule,
        ranks=_ranks(cfg),
        virtual=cfg.virtual,
        dp_mode=cfg.dp_mode,
    )
    b = training.global_batch // (cfg.dp * cfg.m)
    types = sorted({cfg.cluster.devices[r].device.key for st in cfg.grid for r in st})
    return CostModel({t: cfg.profile_for(t, b) for t in types}, cfg.cluster, training, layout)


def _ranks(cfg: Config) -> tuple[tuple[int, ...], ...]:
    """Per stage, its ranks (one per replica): its pipeline rank's (``cfg.grid`` is per
    pipeline rank; with v stages per rank, stage i runs where the schedule places it)."""
    return tuple(cfg.grid[k] for k in stage_ranks(cfg.schedule, cfg.pp, cfg.virtual))


def _proven(
    best: SearchResult,
    options: SearchOptions,
    allowed: frozenset[int] | None,
    tried: list[tuple[Config, Candidate]],
) -> SearchResult:
    """The chosen configuration, proven: a bounded problem searched only during the
    search gets its MILP now (which may also find a faster placement: its candidate
    row then says so)."""
    if best.solution.method != "search":
        return best
    # The search's placement already descends from the closed-form ILP's: not solved twice.
    sol = place(best.cost, options, allowed, prove=True, starts=[best.starts], closed_form=False)
    pred = best.cost.predict(sol.starts)
    for k, (cfg, cand) in enumerate(tried):
        lay = best.layout
        same = (cfg.pp, cfg.dp, cfg.m, cfg.schedule, cfg.virtual, cfg.dp_mode) == (
            lay.pp,
            lay.dp,
            lay.micro_batches,
            lay.schedule,
            lay.virtual,
            lay.dp_mode,
        ) and (_ranks(cfg), cfg.cluster) == (lay.ranks, best.cost.cluster)
        if same and cand.step_ms is not None:
            tried[k] = (cfg, dataclasses.replace(cand, step_ms=pred.step_ms))
    return SearchResult(layout=best.layout, solution=sol, prediction=pred, cost=best.cost)


def place(
    cost: CostModel,
    options: SearchOptions,
    allowed: frozenset[int] | None = None,
    names: Sequence[str] = (),
    *,
    prove: bool = True,
    starts: Sequence[tuple[int, ...]] = (),
    closed_form: bool = True,
    ceiling: float | None = None,
) -> StepSolution:
    """The placement of least simulated step for ``cost``'s layout, and its proof.

    ``prove=False``: where stages share cores, search only (the bound's MILP
    is left for the configuration the plan keeps: see ``solve_step``).
    ``starts``: more placements to start from. ``closed_form=False``: not the
    closed-form ILP's (a placement of ``starts`` already descends from it; nor
    above ``CLOSED_FORM_MAX`` blocks × stages).
    ``ceiling``: the best step of the configurations before (``solve_step``).

    The closed-form ILP's placement and the usual heuristics' (uniform,
    parameter- and time-balanced, DeepSpeed's where cheap) are the step
    solver's warm starts, made as it asks for them; both solves share
    ``options.time_limit_s``. The closed-form solver assumes that
    a run of blocks that does not fit never fits once extended; a stage's
    receive buffers follow the tensors crossing its ends, so a longer run can
    fit where a shorter one does not, and its "nothing fits" is only believed
    when the step solver, which asks every run, agrees.

    Raises:
        PartitionInfeasible: no placement fits memory (the message says which
            stage needs what).
        PartitionTimeout: the limit ran out before any placement was found.
    """
    limit = options.time_limit_s
    refused: list[PartitionInfeasible] = []

    def seeds() -> Iterator[tuple[int, ...]]:
        """The warm starts, each made when the step solver asks for it (a configuration
        its bounds prune against the ceiling needs one placement, not all of them)."""
        blocks = cost.profile.blocks
        heuristics = baselines.warm_starts(
            [b.param_bytes for b in blocks],
            [b.fwd_ms + b.bwd_ms for b in blocks],
            cost.layout.n_stages,
            allowed,
        )
        yield from starts
        first = next(heuristics, None)  # uniform: the cheapest
        if first is not None:
            yield first
        if closed_form and closed_form_pays(cost):
            try:
                yield solve_partition(
                    partition_problem(cost, allowed, names),
                    solver=options.solver,
                    time_limit_s=limit,
                ).starts
            except PartitionInfeasible as exc:
                refused.append(exc)
        yield from heuristics

    try:
        return solve_step(
            step_problem(cost, allowed, names),
            solver=options.solver,
            time_limit_s=limit,
            warm_starts=seeds(),
            prove=prove,
            ceiling=ceiling,
        )
    except PartitionInfeasible:
        if refused:
            raise refused[0] from None  # its message names the block and the numbers
        raise
