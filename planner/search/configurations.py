"""The configurations the search considers, the ways to lay each on the ranks, and their bounds.

A configuration is (pp, dp, m, schedule, v) with pp · dp devices, v stages per
pipeline rank (``MULTI_STAGE`` schedules: Interleaved 1F1B, Looped BFS; 1
otherwise) and a micro-batch size b = B / (dp · m) that divides the global batch; a *layout*
of it says which rank runs which stage of which replica. Each gets a lower
bound on its step from the work alone (:func:`planner.cost.step_time.work_bound`)
and, on GPUs, from the chain of the stages' gradient all-reduces that every
placement waits on (:func:`planner.cost.step_time.reduce_chain_bound`), and the
search visits them best bound first.

[Note: fewer CPU processes] On GPUs pp · dp is every device. Processes on the
local CPU share its cores, so fewer of them, each with more torch threads, can
be faster (one process on both cores of a 2-core machine beat every pipelined
run by 1.45–2.05×, bench/results/runtime.json): on a local CPU cluster
(:func:`local_cpu`) pp · dp may be any count up to the processes given (unless
``SearchOptions.every_device``: auto_parallel under torchrun, whose process count is
fixed), and each configuration is also tried with every thread count t dividing
the cores with pp · dp · t ≤ cores (besides the cluster's own), each priced from a
profile measured at t threads (``ThreadsFor``). The single process is always
among them, so a pipelined CPU plan is only chosen when predicted faster.

Pure: no torch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from planner.cost.basis import wire_bytes
from planner.cost.stage_time import corun_slowdown
from planner.cost.step_time import (
    allreduce_floor,
    reduce_chain_bound,
    shared_cores_bound,
    work_bound,
)
from planner.devices.cluster import Cluster
from planner.options import SearchOptions, Training
from planner.plan.records import ModelProfile
from planner.plan.schedule import SPLIT_BACKWARD
from planner.search.messages import nothing_possible
from planner.search.schedules import Rejection, schedules

__all__ = [
    "Config",
    "ProfileFor",
    "ThreadsFor",
    "bounded",
    "configurations",
    "layouts",
    "local_cpu",
    "thread_counts",
]

ProfileFor = Callable[[str, int], ModelProfile]
"""profile_for(device_type, micro_batch_size) -> the model's profile there."""

ThreadsFor = Callable[[int], tuple[Cluster, ProfileFor]]
"""threads_for(t) -> (the local CPU cluster with each process measured at, and given, t
torch threads; the model's profiles measured at t threads): [Note: fewer CPU processes]."""

Grid = tuple[tuple[int, ...], ...]


@dataclass(order=True)
class Config:
    """A configuration laid on the ranks, with its lower bound (the sort key).

    ``cluster``: the devices it runs on (on a local CPU, its pp · dp processes with
    ``threads`` torch threads each); ``profile_for``: the profiles measured for them.
    """

    bound: float
    pp: int
    dp: int
    m: int
    schedule: str
    threads: int
    layout_name: str = field(compare=False)
    grid: Grid = field(compare=False)
    cluster: Cluster = field(compare=False, repr=False)
    profile_for: ProfileFor = field(compare=False, repr=False)
    virtual: int = field(default=1, compare=False)
    dp_mode: str = field(default="ddp", compare=False)


def local_cpu(cluster: Cluster) -> bool:
    """True for processes on this machine's CPU (one node, gloo, alike): the search may
    use fewer of them, with more threads each ([Note: fewer CPU processes])."""
    return cluster.backend == "gloo" and cluster.n_nodes == 1 and cluster.homogeneous


def thread_counts(cluster: Cluster, processes: int) -> list[int]:
    """The torch threads per process tried for ``processes`` processes of ``cluster``.

    A local CPU cluster: its own thread count, and every divisor t of the cores
    with processes · t ≤ cores (more threads than cores are time-sliced, priced by
    :func:`planner.cost.stage_time.cpu_speeds`, and never faster). Elsewhere the
    cluster's own (0 on GPUs).

    Example::

        thread_counts(from_gpus(8), 1)   # on 2 cores: [1, 2]
    """
    own = cluster.devices[0].threads
    if not local_cpu(cluster):
        return [own]
    cores = cluster.cores_per_node
    fit = {t for t in range(1, cores + 1) if cores % t == 0 and processes * t <= cores}
    return sorted(fit | {own})


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
    """Layouts with equal device types and node pattern cost the same.

    The pattern is which positions of the grid share a node (nodes numbered as the
    grid first meets them): the cost model asks only whether two ranks share one.
    On single-device nodes "pipeline-inside" and "replicas-inside" are then one
    layout (every link between nodes), as on one node.
    """
    if cluster.homogeneous and cluster.n_nodes == 1:
        return ()
    seen: dict[int, int] = {}
    return tuple(
        tuple(
            (cluster.devices[r].device.key, seen.setdefault(cluster.devices[r].node, len(seen)))
            for r in stage
        )
        for stage in grid
    )


def configurations(
    cluster: Cluster,
    training: Training,
    options: SearchOptions,
    n_blocks: int | None = None,
    allowed_starts: frozenset[int] | None = None,
) -> list[tuple[int, int, int, str, int]]:
    """Every (pp, dp, micro_batches, schedule, virtual) the search considers.

    Multi-stage schedules (``MULTI_STAGE``) are tried at every v from 2 to
    ``options.max_virtual`` with pp · v stages no more than the blocks can make
    (v = 1 of Interleaved 1F1B is 1F1B); ``options.virtual`` pins v.

    Raises:
        ValueError: none is possible; the message gives the arithmetic of each
            rejection (batch divisibility, devices, more stages than blocks).
    """
    rejected: list[Rejection] = []
    out: list[tuple[int, int, int, str, int]] = []
    n_dev = cluster.n_devices
    fewer = local_cpu(cluster) and not options.every_device  # [Note: fewer CPU processes]
    if n_blocks is None:
        max_stages = n_dev
    else:
        max_stages = (len(allowed_starts) if allowed_starts is not None else n_blocks - 1) + 1
    pps = (
        [options.pp] if options.pp else [p for p in range(1, n_dev + 1) if fewer or n_dev % p == 0]
    )
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
        for dp in _widths(pp, n_dev, training.global_batch, options, rejected, fewer):
            for m in _micro_batch_counts(training.global_batch, dp, options, rejected):
                room = max_stages if n_blocks is not None else 2**31  # blocks unknown
                out += schedules(pp, dp, m, options, rejected, room)
    if not out:
        raise ValueError(nothing_possible(training, cluster, options, rejected))
    return out


def _widths(
    pp: int,
    n_dev: int,
    batch: int,
    options: SearchOptions,
    rejected: list[Rejection],
    fewer: bool = False,
) -> list[int]:
    """The data-parallel widths for pipeline depth ``pp`` (with the rejections said why):
    dp = devices / pp, or with ``fewer`` every dp with pp · dp ≤ devices."""
    got = _widths_of(pp, n_dev, batch, options, rejected, fewer)
    if options.dp_mode in ("ddp", "auto") or 1 not in got:
        return got
    rejected.append(
        (
            f"pp {pp} × dp 1: no replicas to share the optimizer state among "
            f"(--dp-mode {options.dp_mode} needs dp ≥ 2)",
            "--dp-mode ddp or auto, or a dp ≥ 2",
        )
    )
    return [d for d in got if d > 1]


def _widths_of(
    pp: int, n_dev: int, batch: int, options: SearchOptions, rejected: list[Rejection], fewer: bool
) -> list[int]:
    """:func:`_widths`, whatever the dp mode."""
    if options.dp:
        dps = [options.dp]
    elif fewer:
        dps = [d for d in range(1, n_dev // pp + 1) if batch % d == 0] or [n_dev // pp]
    else:
        dps = [n_dev // pp] if n_dev % pp == 0 else []
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


def _batch_sizes(batch: int, step: int) -> str:
    """'--batch-size 28 or 32': the multiples of ``step`` nearest ``batch``."""
    lo, hi = batch // step * step, (batch // step + 1) * step
    return f"--batch-size {lo} or {hi}" if lo else f"--batch-size {hi}"


def bounded(
    profile_for: ProfileFor,
    cluster: Cluster,
    training: Training,
    configs: list[tuple[int, int, int, str, int]],
    threads_for: ThreadsFor | None = None,
    dp_modes: tuple[str, ...] = ("ddp",),
) -> list[Config]:
    """Every configuration laid on the ranks, with its lower bound, best bound first.

    ``dp_modes``: each configuration with dp ≥ 2 is tried in each of these
    (``SearchOptions.dp_modes``); one with dp 1 has no replicas, and runs DDP's
    way. The bounds price forwards, backwards and the gradients' all-reduce, which
    ZeRO-1 leaves as they are; FSDP has no all-reduce in the last backwards (its
    reduce-scatters are in the stages' tails, which overlap: [Note: FSDP as it
    runs]), so its configurations are bounded by the work alone.

    On a local CPU cluster each is tried with every count of :func:`thread_counts`
    that ``threads_for`` can give (only the cluster's own without it), on its first
    pp · dp processes, bounded also by the cores they share
    (:func:`~planner.cost.step_time.shared_cores_bound`).
    """
    own = cluster.devices[0].threads
    variants: dict[int, tuple[Cluster, ProfileFor]] = {own: (cluster, profile_for)}
    fastest: dict[tuple[int, int], tuple[float, float, float, float, int]] = {}
    cpu = local_cpu(cluster)
    out = []
    for pp, dp, m, sched, v in configs:
        b = training.global_batch // (dp * m)
        counts = thread_counts(cluster, pp * dp) if threads_for is not None else [own]
        for t in counts:
            if t not in variants:
                assert threads_for is not None
                variants[t] = threads_for(t)
            full, prof_for = variants[t]
            if (t, b) not in fastest:
                fastest[(t, b)] = _work(prof_for, full, b, training)
            total, heaviest, last, wire, free = fastest[(t, b)]
            bound = work_bound(total, heaviest, pp, m, sched, v)
            used = full
            if cpu:
                corun = corun_slowdown(prof_for(full.device_types[0], b), dp)
                cores = full.cores_per_node
                bound = max(bound, shared_cores_bound(total, pp, dp, m, t, cores, corun))
                used = _first(full, pp * dp)
            label = f", {t} thread{'s' if t != 1 else ''} per process" if cpu else ""
            for name, grid in layouts(used, pp, dp):
                lb = bound
                # GPUs: every speed 1, graph = step; a split backward's all-reduce follows its
                # last W, off the gradients' way back ([Note: bounds under a split backward])
                if full.backend != "gloo" and dp > 1 and sched not in SPLIT_BACKWARD:
                    reduces = allreduce_floor(used.allreduce_time, grid, wire, free)
                    lb = max(lb, reduce_chain_bound(total, last, m, reduces))
                for mode in dp_modes if dp > 1 else ("ddp",):
                    low = bound if mode == "fsdp" else lb
                    out.append(
                        Config(
                            low, pp, dp, m, sched, t, name + label, grid, used, prof_for, v, mode
                        )
                    )
    out.sort()
    return out


def _first(cluster: Cluster, n: int) -> Cluster:
    """The first ``n`` processes of a local CPU cluster: what a plan on n of them runs on."""
    if n == cluster.n_devices:
        return cluster
    devices = cluster.devices[:n]
    return dataclasses.replace(cluster, name=f"{n}x{devices[0].device.key}", devices=devices)


def _work(
    profile_for: ProfileFor, cluster: Cluster, b: int, training: Training
) -> tuple[float, float, float, float, int]:
    """(Σ block work, heaviest block, last block with the loss) at micro-batch b on the
    fastest device type, the least gradient bytes an all-reduce of them all moves, and
    the blocks that hold no parameter."""
    best_total = best_heavy = best_last = best_wire = math.inf
    free = 0
    for t in cluster.device_types:
        prof = profile_for(t, b)
        works = [x.fwd_ms + x.bwd_ms for x in prof.blocks]
        loss = prof.loss_fwd_ms + prof.loss_bwd_ms
        best_total = min(best_total, sum(works) + loss)
        best_heavy = min(best_heavy, max(works))
        best_last = min(best_last, works[-1] + loss)
        best_wire = min(best_wire, wire_bytes(prof, training))
        free = sum(x.param_bytes == 0 for x in prof.blocks)
    return best_total, best_heavy, best_last, best_wire, free
