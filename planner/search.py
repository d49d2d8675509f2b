"""Search over pipeline depth, data-parallel width, micro-batches and schedule.

For every configuration (pp, dp, m, schedule) with pp · dp devices and a
micro-batch size b = B / (dp · m) that divides the global batch, and for each
way of laying the stages on the cluster's ranks:

1. a **lower bound** on its step time, from the work alone (each stage at
   least an even share of the total and at least the heaviest block); a
   configuration whose bound cannot beat the best found so far is *pruned*
   without solving anything;
2. otherwise the **ILP** (``solve``) places the blocks, and the cost model
   **simulates** the placement's schedule: that simulated step time ranks the
   configurations.

Configurations are visited in order of their bound, so the best is usually
found early and most others are pruned. The ranked candidates are kept with
why each lost. Any of pp, dp, m and the schedule can be pinned.

Activation recompute is chosen per stage inside the cost model: a stage
recomputes only when it would not fit otherwise.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from planner import baselines
from planner.cluster import Cluster
from planner.cost import CostModel, Layout, Prediction, Training
from planner.plan import Candidate
from planner.records import ModelProfile
from planner.search_messages import _first_line, _nothing_fits, _nothing_possible, _warnings
from planner.simulate import SCHEDULES
from planner.solve import (
    PartitionInfeasible,
    PartitionSolution,
    PartitionTimeout,
    solve_partition,
)

__all__ = ["SearchOptions", "SearchResult", "configurations", "layouts", "search"]

log = logging.getLogger(__name__)

ProfileFor = Callable[[str, int], ModelProfile]
"""profile_for(device_type, micro_batch_size) -> the model's profile there."""


@dataclass(frozen=True, kw_only=True)
class SearchOptions:
    """What to search, and what is pinned.

    Attributes:
        pp, dp, micro_batches, schedule: pin a choice (None: search it).
        solver: "highs" (default), "cbc" or "auto".
        time_limit_s: per-ILP time limit; the best placement found by then is
            kept and marked not proven optimal, with its gap.
        max_micro_batches: the largest m considered.
        keep: how many candidates the plan records.
    """

    pp: int | None = None
    dp: int | None = None
    micro_batches: int | None = None
    schedule: str | None = None
    solver: str = "highs"
    time_limit_s: float | None = 60.0
    max_micro_batches: int = 64
    keep: int = 12

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "micro_batches"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be ≥ 1, got {v}")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise ValueError(
                f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}"
            )
        if self.time_limit_s is not None and self.time_limit_s <= 0:
            raise ValueError(f"--time-limit must be > 0 seconds, got {self.time_limit_s}")


@dataclass
class SearchResult:
    """The winner, and every candidate with its fate."""

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


def layouts(cluster: Cluster, pp: int, dp: int) -> list[tuple[str, tuple[tuple[int, ...], ...]]]:
    """Ways to lay pp stages × dp replicas on the first pp·dp ranks.

    "pipeline-inside": replica r holds ranks r·pp … r·pp + pp − 1 (stages talk
    over the fastest links; gradients all-reduce across them).
    "replicas-inside": stage s holds ranks s·dp … s·dp + dp − 1 (each stage's
    replicas sit together; one device type per stage on mixed clusters).
    Each also reversed (the last ranks take the first stages), which matters
    when device types differ. Duplicates are dropped.
    """
    n = pp * dp
    orders = {"": list(range(n))}
    if not cluster.homogeneous:
        orders["reversed "] = list(reversed(range(n)))
    out: list[tuple[str, tuple[tuple[int, ...], ...]]] = []
    seen: set[tuple[tuple[int, ...], ...]] = set()
    for prefix, ranks in orders.items():
        for name, fn in (
            ("pipeline-inside", lambda s, r: r * pp + s),
            ("replicas-inside", lambda s, r: s * dp + r),
        ):
            grid = tuple(tuple(ranks[fn(s, r)] for r in range(dp)) for s in range(pp))
            key = _signature(cluster, grid)
            if key in seen:
                continue
            seen.add(key)
            out.append((prefix + name, grid))
    return out


def _signature(cluster: Cluster, grid: tuple[tuple[int, ...], ...]) -> tuple:
    """Layouts with equal device types and node pattern cost the same."""
    if cluster.homogeneous and cluster.n_nodes == 1:
        return ()
    return tuple(
        tuple((cluster.devices[r].device.key, cluster.devices[r].node) for r in stage)
        for stage in grid
    )


@dataclass(order=True)
class _Config:
    bound: float
    pp: int
    dp: int
    m: int
    schedule: str
    layout_name: str = field(compare=False)
    grid: tuple[tuple[int, ...], ...] = field(compare=False)


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
    tried: list[tuple[_Config, Candidate]] = []
    solved: list[SearchResult] = []
    best: SearchResult | None = None
    best_ms = math.inf
    oom_costs: list[CostModel] = []  # for the message when nothing fits
    for cfg in _bounded(profile_for, cluster, training, configs):
        if cfg.bound >= best_ms:
            tried.append(
                (
                    cfg,
                    _candidate(
                        cfg,
                        None,
                        "pruned",
                        f"lower bound {cfg.bound:.1f} ms ≥ best {best_ms:.1f} ms",
                    ),
                )
            )
            continue
        layout = Layout(
            pp=cfg.pp, dp=cfg.dp, micro_batches=cfg.m, schedule=cfg.schedule, ranks=cfg.grid
        )
        b = training.global_batch // (cfg.dp * cfg.m)
        types = sorted({cluster.devices[r].device.key for st in cfg.grid for r in st})
        cost = CostModel({t: profile_for(t, b) for t in types}, cluster, training, layout)
        try:
            sol = solve_partition(
                cost.problem(allowed_starts, block_names or ()),
                solver=options.solver,
                time_limit_s=options.time_limit_s,
            )
        except PartitionInfeasible as exc:
            tried.append((cfg, _candidate(cfg, None, "out_of_memory", _first_line(str(exc)))))
            oom_costs.append(cost)
            continue
        except PartitionTimeout as exc:
            tried.append((cfg, _candidate(cfg, None, "timeout", _first_line(str(exc)))))
            continue
        pred = cost.predict(sol.starts)
        tried.append((cfg, _candidate(cfg, pred.step_ms, "solved", "")))
        solved.append(SearchResult(layout=layout, solution=sol, prediction=pred, cost=cost))
        if pred.step_ms < best_ms:
            best_ms = pred.step_ms
            best = solved[-1]
    if best is not None:
        # [Note: refining by simulation] The ILP minimises the closed form; the
        # simulated schedule is the prediction. They agree for GPipe up to the
        # forward/backward bottleneck split and only approximately for 1F1B, so
        # the best few placements are polished against the simulation.
        top = sorted(solved, key=lambda r: r.prediction.step_ms)[:_REFINE_TOP]
        for res in top:
            _refine(res, allowed_starts)
            for k, (cfg, cand) in enumerate(tried):
                if (
                    cand.step_ms is not None
                    and _same(cfg, res)
                    and cand.step_ms > res.prediction.step_ms
                ):
                    tried[k] = (cfg, _with(cand, cand.status, cand.reason, res.prediction.step_ms))
        best = min(top, key=lambda r: r.prediction.step_ms)
        best_ms = best.prediction.step_ms
    if best is None:
        raise ValueError(_nothing_fits(tried, oom_costs, cluster, training, options))
    best.candidates = _ranked(tried, best, best_ms, options.keep)
    best.warnings = _warnings(best, options)
    return best


def configurations(
    cluster: Cluster,
    training: Training,
    options: SearchOptions,
    n_blocks: int | None = None,
    allowed_starts: frozenset[int] | None = None,
) -> list[tuple[int, int, int, str]]:
    """Every (pp, dp, micro_batches, schedule) the search considers.

    Raises:
        ValueError: none is possible; the message gives the arithmetic of each
            rejection (batch divisibility, devices, more stages than blocks).
    """
    configs, rejected = _enumerate(cluster, training, options, n_blocks, allowed_starts)
    if not configs:
        raise ValueError(_nothing_possible(training, cluster, options, rejected))
    return configs


def _enumerate(
    cluster: Cluster,
    training: Training,
    options: SearchOptions,
    n_blocks: int | None,
    allowed_starts: frozenset[int] | None,
) -> tuple[list[tuple[int, int, int, str]], list[tuple[str, str]]]:
    """The configurations, and (why, fix) for each one rejected."""
    n_dev = cluster.n_devices
    batch = training.global_batch
    if n_blocks is None:
        max_stages = n_dev
    else:
        max_stages = (len(allowed_starts) if allowed_starts is not None else n_blocks - 1) + 1
    rejected: list[tuple[str, str]] = []
    out: list[tuple[int, int, int, str]] = []
    pps = [options.pp] if options.pp else [p for p in range(1, n_dev + 1) if n_dev % p == 0]
    for pp in pps:
        if pp > max_stages:
            rejected.append(
                (
                    f"pp {pp} > {max_stages}: the model has {max_stages} block(s) that can "
                    f"start a stage ({max_stages - 1} legal split point(s)), so at most "
                    f"{max_stages} stage(s)",
                    f"--pp {max_stages} or fewer (or leave --pp unset)",
                )
            )
            continue
        dps = [options.dp] if options.dp else ([n_dev // pp] if n_dev % pp == 0 else [])
        if not dps:
            divisors = ", ".join(str(p) for p in range(1, n_dev + 1) if n_dev % p == 0)
            rejected.append(
                (
                    f"pp {pp} does not divide the {n_dev} devices "
                    f"(dp = {n_dev} / {pp} = {n_dev / pp:g} is not whole)",
                    f"--pp among {divisors}, or a --dp with pp × dp ≤ {n_dev}",
                )
            )
        for dp in dps:
            if pp * dp > n_dev:
                rejected.append(
                    (
                        f"pp × dp = {pp} × {dp} = {pp * dp} > {n_dev} devices",
                        f"--pp and --dp with pp × dp ≤ {n_dev}",
                    )
                )
                continue
            if batch % dp:
                rejected.append(
                    (
                        f"batch {batch} not divisible by dp {dp} ({batch} / {dp} = {batch / dp:g})",
                        f"{_batch_sizes(batch, dp)} (multiples of dp {dp}), or a --dp that "
                        f"divides {batch}",
                    )
                )
                continue
            per_replica = batch // dp
            ms = (
                [options.micro_batches]
                if options.micro_batches
                else [
                    m
                    for m in range(1, min(per_replica, options.max_micro_batches) + 1)
                    if per_replica % m == 0
                ]
            )
            for m in ms:
                if per_replica % m:
                    ok = [k for k in range(1, per_replica + 1) if per_replica % k == 0]
                    rejected.append(
                        (
                            f"replica batch {per_replica} (= {batch} / dp {dp}) not divisible "
                            f"by {m} micro-batches ({per_replica} / {m} = {per_replica / m:g})",
                            f"--micro-batches among {', '.join(map(str, ok[:12]))}, or "
                            f"{_batch_sizes(batch, dp * m)} (multiples of dp × micro-batches "
                            f"= {dp} × {m})",
                        )
                    )
                    continue
                for sched in [options.schedule] if options.schedule else list(SCHEDULES):
                    if pp == 1 and sched == "1f1b":
                        continue  # one stage: both schedules are the same
                    if sched == "1f1b" and m < pp:
                        # torch's Schedule1F1B needs a micro-batch per stage in flight.
                        rejected.append(
                            (
                                f"1f1b needs micro-batches ≥ stages (m {m} < pp {pp})",
                                f"--schedule gpipe, or --micro-batches {pp} or more",
                            )
                        )
                        continue
                    out.append((pp, dp, m, sched))
    return out, rejected


def _batch_sizes(batch: int, step: int) -> str:
    """'--batch-size 28 or 32': the multiples of ``step`` nearest ``batch``."""
    lo, hi = batch // step * step, (batch // step + 1) * step
    return f"--batch-size {lo} or {hi}" if lo else f"--batch-size {hi}"


def _bounded(
    profile_for: ProfileFor,
    cluster: Cluster,
    training: Training,
    configs: list[tuple[int, int, int, str]],
) -> Iterator[_Config]:
    """Configurations with their lower bounds, best bound first."""
    fastest: dict[int, tuple[float, float]] = {}
    out = []
    for pp, dp, m, sched in configs:
        b = training.global_batch // (dp * m)
        if b not in fastest:
            fastest[b] = _work_bounds(profile_for, cluster, b)
        total, heaviest = fastest[b]
        share = max(total / pp, heaviest)
        bound = total + (m - 1) * share
        for name, grid in layouts(cluster, pp, dp):
            out.append(_Config(bound, pp, dp, m, sched, name, grid))
    out.sort()
    yield from out


def _work_bounds(profile_for: ProfileFor, cluster: Cluster, b: int) -> tuple[float, float]:
    """(Σ block work, heaviest block) at micro-batch b on the fastest device type."""
    best_total, best_heavy = math.inf, math.inf
    for t in cluster.device_types:
        prof = profile_for(t, b)
        works = [x.fwd_ms + x.bwd_ms for x in prof.blocks]
        best_total = min(best_total, sum(works) + prof.loss_fwd_ms + prof.loss_bwd_ms)
        best_heavy = min(best_heavy, max(works))
    return best_total, best_heavy


def _candidate(cfg: _Config, step_ms: float | None, status: str, reason: str) -> Candidate:
    return Candidate(
        pp=cfg.pp,
        dp=cfg.dp,
        micro_batches=cfg.m,
        schedule=cfg.schedule,
        step_ms=step_ms,
        status=status,
        reason=(f"{cfg.layout_name}: {reason}" if reason else cfg.layout_name),
    )


def _ranked(
    tried: list[tuple[_Config, Candidate]], best: SearchResult, best_ms: float, keep: int
) -> list[Candidate]:
    solved = sorted(
        (c for _, c in tried if c.step_ms is not None), key=lambda c: (c.step_ms, c.pp, c.dp)
    )
    out: list[Candidate] = []
    chosen = False
    for c in solved:
        if (
            not chosen
            and c.step_ms == best_ms
            and (c.pp, c.dp, c.micro_batches, c.schedule)
            == (best.layout.pp, best.layout.dp, best.layout.micro_batches, best.layout.schedule)
        ):
            out.append(_with(c, "chosen", f"{c.reason}: fastest predicted step"))
            chosen = True
        else:
            assert c.step_ms is not None
            slower = (c.step_ms - best_ms) / best_ms
            out.append(_with(c, "slower", f"{c.reason}: {c.step_ms:.1f} ms, +{slower:.1%}"))
    # The solved ones first (best first), but keep room for a configuration that
    # ran out of memory and one that was pruned, so the table shows why they lost;
    # then fill up with whatever is left.
    others = [c for _, c in tried if c.step_ms is None]
    oom = [c for c in others if c.status == "out_of_memory"]
    rest = [c for c in others if c.status != "out_of_memory"]
    head = out[: max(keep - 2, 1)]
    tail = out[len(head) :] + oom[1:] + rest[1:]
    return (head + oom[:1] + rest[:1] + tail)[:keep]


def _with(c: Candidate, status: str, reason: str, step_ms: float | None = None) -> Candidate:
    return Candidate(
        pp=c.pp,
        dp=c.dp,
        micro_batches=c.micro_batches,
        schedule=c.schedule,
        step_ms=c.step_ms if step_ms is None else step_ms,
        status=status,
        reason=reason,
    )


_REFINE_TOP = 4  # configurations polished by simulation
_REFINE_BUDGET = 120  # simulations per configuration


def _same(cfg: _Config, res: SearchResult) -> bool:
    lay = res.layout
    return (cfg.pp, cfg.dp, cfg.m, cfg.schedule, cfg.grid) == (
        lay.pp,
        lay.dp,
        lay.micro_batches,
        lay.schedule,
        lay.ranks,
    )


def _refine(res: SearchResult, allowed: frozenset[int] | None) -> None:
    """Polish ``res`` in place: the ILP's placement and the usual heuristics'
    placements as seeds, then moves of one split point by one or two blocks
    while the simulated step improves and every stage fits."""
    cost, n, pp = res.cost, res.cost.n_blocks, res.layout.pp
    if pp == 1:
        return
    legal = set(allowed) if allowed is not None else set(range(1, n))
    prof = cost.profile
    seeds = [tuple(res.solution.starts)]
    for seed in (
        baselines.uniform(n, pp, allowed),
        baselines.parameter_balanced([b.param_bytes for b in prof.blocks], pp, allowed),
        baselines.time_balanced([b.fwd_ms + b.bwd_ms for b in prof.blocks], pp, allowed),
    ):
        if len(seed) == pp and seed not in seeds:
            seeds.append(tuple(seed))
    best_starts, best = seeds[0], res.prediction
    budget = _REFINE_BUDGET
    for seed in seeds[1:]:
        pred = cost.predict(seed)
        budget -= 1
        if pred.fits and pred.step_ms < best.step_ms:
            best_starts, best = seed, pred
    improved = True
    while improved and budget > 0:
        improved = False
        for k in range(1, pp):
            lo = best_starts[k - 1] + 1
            hi = best_starts[k + 1] - 1 if k + 1 < pp else n - 1
            for delta in (-1, 1, -2, 2):
                j = best_starts[k] + delta
                if not lo <= j <= hi or j not in legal or budget <= 0:
                    continue
                trial = (*best_starts[:k], j, *best_starts[k + 1 :])
                pred = cost.predict(trial)
                budget -= 1
                if pred.fits and pred.step_ms < best.step_ms * (1 - 1e-9):
                    best_starts, best, improved = trial, pred, True
                    break
    if best_starts != tuple(res.solution.starts):
        gain = 1 - best.step_ms / res.prediction.step_ms
        res.refined = f"the ILP's placement refined by simulation: −{gain:.2%} step time"
        res.prediction = best
        res.starts = best_starts
