"""The search: every configuration, bounded, solved, simulated, ranked; the fastest wins.

For every configuration (pp, dp, m, schedule) and each way of laying it on
the cluster's ranks (:mod:`planner.search.configurations`):

1. a **lower bound** on its step time, from the work alone; a configuration
   whose bound cannot beat the best found so far is *pruned* without solving;
2. otherwise the **ILP** (:mod:`planner.solve`) places the blocks, and the
   cost model **simulates** the placement's schedule: that simulated step
   ranks the configurations.

Configurations are visited in order of their bound, so the best is usually
found early and most others are pruned; the best few are then polished
against the simulation (:mod:`planner.search.refine`). The ranked candidates
are kept with why each lost. Any of pp, dp, m and the schedule can be pinned.

Activation recompute is chosen per stage inside the cost model: a stage
recomputes only when it would not fit otherwise.

Pure: no torch.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field

from planner.cost.basis import Layout
from planner.cost.model import CostModel, Prediction
from planner.devices.cluster import Cluster
from planner.options import SearchOptions, Training
from planner.plan.sections import Candidate
from planner.plan.text import first_line
from planner.search.configurations import Config, ProfileFor, bounded, configurations
from planner.search.messages import nothing_fits, plan_warnings
from planner.search.partition import partition_problem
from planner.search.ranking import candidate, ranked
from planner.search.refine import REFINE_TOP, refine
from planner.solve.partition import solve_partition
from planner.solve.problem import PartitionInfeasible, PartitionSolution, PartitionTimeout

__all__ = ["SearchResult", "search"]

log = logging.getLogger(__name__)


@dataclass
class SearchResult:
    """The winner, and every candidate with its fate.

    Attributes:
        layout, cost: the chosen configuration and its cost model.
        solution: the solver's answer for it.
        starts, prediction: the chosen placement and its predicted step (the
            solver's, or the refined one: ``refined`` says what changed).
        candidates: what the plan records of the search (ranked).
        warnings: the chosen plan's performance hazards.
    """

    layout: Layout
    solution: PartitionSolution
    prediction: Prediction
    cost: CostModel
    candidates: list[Candidate] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    starts: tuple[int, ...] = ()
    refined: str = ""

    def __post_init__(self) -> None:
        if not self.starts:
            self.starts = tuple(self.solution.starts)


def search(
    profile_for: ProfileFor,
    cluster: Cluster,
    training: Training,
    options: SearchOptions | None = None,
    *,
    allowed_starts: frozenset[int] | None = None,
    block_names: list[str] | None = None,
    n_blocks: int,
) -> SearchResult:
    """Find the configuration and placement with the shortest predicted step.

    Raises:
        ValueError: no configuration is possible (the message says why for the
            closest ones: memory per stage against capacity, batch divisibility,
            more stages than split points).
    """
    options = options or SearchOptions()
    configs = configurations(cluster, training, options, n_blocks, allowed_starts)
    tried: list[tuple[Config, Candidate]] = []
    solved: list[SearchResult] = []
    best_ms = math.inf
    oom_costs: list[CostModel] = []  # for the message when nothing fits
    for cfg in bounded(profile_for, cluster, training, configs):
        if cfg.bound >= best_ms:
            why = f"lower bound {cfg.bound:.1f} ms ≥ best {best_ms:.1f} ms"
            tried.append((cfg, candidate(cfg, None, "pruned", why)))
            continue
        layout = Layout(
            pp=cfg.pp, dp=cfg.dp, micro_batches=cfg.m, schedule=cfg.schedule, ranks=cfg.grid
        )
        b = training.global_batch // (cfg.dp * cfg.m)
        types = sorted({cluster.devices[r].device.key for st in cfg.grid for r in st})
        cost = CostModel({t: profile_for(t, b) for t in types}, cluster, training, layout)
        problem = partition_problem(cost, allowed_starts, block_names or ())
        try:
            sol = solve_partition(problem, solver=options.solver, time_limit_s=options.time_limit_s)
        except PartitionInfeasible as exc:
            tried.append((cfg, candidate(cfg, None, "out_of_memory", first_line(exc))))
            oom_costs.append(cost)
            continue
        except PartitionTimeout as exc:
            tried.append((cfg, candidate(cfg, None, "timeout", first_line(exc))))
            continue
        pred = cost.predict(sol.starts)
        tried.append((cfg, candidate(cfg, pred.step_ms, "solved", "")))
        solved.append(SearchResult(layout=layout, solution=sol, prediction=pred, cost=cost))
        best_ms = min(best_ms, pred.step_ms)
    if not solved:
        records = [c for _, c in tried]
        raise ValueError(nothing_fits(records, oom_costs, cluster, training, options))
    best = _polished(solved, tried, allowed_starts)
    best_ms = best.prediction.step_ms
    best.candidates = ranked([c for _, c in tried], best.layout, best_ms, options.keep)
    best.warnings = plan_warnings(best.layout, best.solution, best.prediction, options)
    return best


def _polished(
    solved: list[SearchResult],
    tried: list[tuple[Config, Candidate]],
    allowed: frozenset[int] | None,
) -> SearchResult:
    """The best of the top few after refining each ([Note: refining by simulation]).

    A candidate's recorded step becomes its refined one when that is faster.
    """
    top = sorted(solved, key=lambda r: r.prediction.step_ms)[:REFINE_TOP]
    for res in top:
        got = refine(res.cost, res.starts, res.prediction, allowed)
        res.starts, res.prediction, res.refined = got.starts, got.prediction, got.note
        step = res.prediction.step_ms
        for k, (cfg, cand) in enumerate(tried):
            if cand.step_ms is not None and _same(cfg, res.layout) and cand.step_ms > step:
                tried[k] = (cfg, dataclasses.replace(cand, step_ms=step))
    return min(top, key=lambda r: r.prediction.step_ms)


def _same(cfg: Config, lay: Layout) -> bool:
    return (cfg.pp, cfg.dp, cfg.m, cfg.schedule, cfg.grid) == (
        lay.pp,
        lay.dp,
        lay.micro_batches,
        lay.schedule,
        lay.ranks,
    )
