"""The configurations the search considers, the ways to lay each on the ranks, and their bounds.

A configuration is (pp, dp, m, schedule) with pp · dp devices and a
micro-batch size b = B / (dp · m) that divides the global batch; a *layout*
of it says which rank runs which stage of which replica. Each gets a lower
bound on its step from the work alone (:func:`planner.cost.step_time.work_bound`),
and the search visits them best bound first.

Pure: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from planner.cost.step_time import work_bound
from planner.devices.cluster import Cluster
from planner.options import SearchOptions, Training
from planner.plan.records import ModelProfile
from planner.plan.schedule import SCHEDULES, schedule_problem
from planner.search.messages import nothing_possible

__all__ = ["Config", "ProfileFor", "bounded", "configurations", "layouts"]

ProfileFor = Callable[[str, int], ModelProfile]
"""profile_for(device_type, micro_batch_size) -> the model's profile there."""

Grid = tuple[tuple[int, ...], ...]
Rejection = tuple[str, str]  # (why, fix)


@dataclass(order=True)
class Config:
    """A configuration laid on the ranks, with its lower bound (the sort key)."""

    bound: float
    pp: int
    dp: int
    m: int
    schedule: str
    layout_name: str = field(compare=False)
    grid: Grid = field(compare=False)


def layouts(cluster: Cluster, pp: int, dp: int) -> list[tuple[str, Grid]]:
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
    out: list[tuple[str, Grid]] = []
    seen: set[tuple[object, ...]] = set()
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


def _signature(cluster: Cluster, grid: Grid) -> tuple[object, ...]:
    """Layouts with equal device types and node pattern cost the same."""
    if cluster.homogeneous and cluster.n_nodes == 1:
        return ()
    return tuple(
        tuple((cluster.devices[r].device.key, cluster.devices[r].node) for r in stage)
        for stage in grid
    )


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
    rejected: list[Rejection] = []
    out: list[tuple[int, int, int, str]] = []
    n_dev = cluster.n_devices
    if n_blocks is None:
        max_stages = n_dev
    else:
        max_stages = (len(allowed_starts) if allowed_starts is not None else n_blocks - 1) + 1
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
        for dp in _widths(pp, n_dev, training.global_batch, options, rejected):
            for m in _micro_batch_counts(training.global_batch, dp, options, rejected):
                out += _schedules(pp, dp, m, options, rejected)
    if not out:
        raise ValueError(nothing_possible(training, cluster, options, rejected))
    return out


def _widths(
    pp: int, n_dev: int, batch: int, options: SearchOptions, rejected: list[Rejection]
) -> list[int]:
    """The data-parallel widths for pipeline depth ``pp`` (with the rejections said why)."""
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
    out = []
    for dp in dps:
        if pp * dp > n_dev:
            rejected.append(
                (
                    f"pp × dp = {pp} × {dp} = {pp * dp} > {n_dev} devices",
                    f"--pp and --dp with pp × dp ≤ {n_dev}",
                )
            )
        elif batch % dp:
            rejected.append(
                (
                    f"batch {batch} not divisible by dp {dp} ({batch} / {dp} = {batch / dp:g})",
                    f"{_batch_sizes(batch, dp)} (multiples of dp {dp}), or a --dp that "
                    f"divides {batch}",
                )
            )
        else:
            out.append(dp)
    return out


def _micro_batch_counts(
    batch: int, dp: int, options: SearchOptions, rejected: list[Rejection]
) -> list[int]:
    """The micro-batch counts m that cut a replica's batch whole."""
    per_replica = batch // dp
    if not options.micro_batches:
        top = min(per_replica, options.max_micro_batches)
        return [m for m in range(1, top + 1) if per_replica % m == 0]
    m = options.micro_batches
    if per_replica % m == 0:
        return [m]
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
    return []


def _schedules(
    pp: int, dp: int, m: int, options: SearchOptions, rejected: list[Rejection]
) -> list[tuple[int, int, int, str]]:
    out = []
    for sched in [options.schedule] if options.schedule else list(SCHEDULES):
        if pp == 1 and sched == "1f1b":
            continue  # one stage: both schedules are the same
        problem = schedule_problem(sched, pp, m)
        if problem is not None:
            rejected.append(problem)
            continue
        out.append((pp, dp, m, sched))
    return out


def _batch_sizes(batch: int, step: int) -> str:
    """'--batch-size 28 or 32': the multiples of ``step`` nearest ``batch``."""
    lo, hi = batch // step * step, (batch // step + 1) * step
    return f"--batch-size {lo} or {hi}" if lo else f"--batch-size {hi}"


def bounded(
    profile_for: ProfileFor,
    cluster: Cluster,
    training: Training,
    configs: list[tuple[int, int, int, str]],
) -> list[Config]:
    """Every configuration laid on the ranks, with its lower bound, best bound first."""
    fastest: dict[int, tuple[float, float]] = {}
    out = []
    for pp, dp, m, sched in configs:
        b = training.global_batch // (dp * m)
        if b not in fastest:
            fastest[b] = _work(profile_for, cluster, b)
        total, heaviest = fastest[b]
        bound = work_bound(total, heaviest, pp, m, sched)
        for name, grid in layouts(cluster, pp, dp):
            out.append(Config(bound, pp, dp, m, sched, name, grid))
    out.sort()
    return out


def _work(profile_for: ProfileFor, cluster: Cluster, b: int) -> tuple[float, float]:
    """(Σ block work, heaviest block) at micro-batch b on the fastest device type."""
    best_total, best_heavy = math.inf, math.inf
    for t in cluster.device_types:
        prof = profile_for(t, b)
        works = [x.fwd_ms + x.bwd_ms for x in prof.blocks]
        best_total = min(best_total, sum(works) + prof.loss_fwd_ms + prof.loss_bwd_ms)
        best_heavy = min(best_heavy, max(works))
    return best_total, best_heavy
