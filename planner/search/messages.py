"""What the search tells the user: warnings on the chosen plan, and why nothing was possible
or nothing fit (with the numbers and the fixes)."""

from __future__ import annotations

from collections.abc import Sequence

from planner.cost.basis import Layout
from planner.cost.model import CostModel, Prediction
from planner.devices.cluster import Cluster
from planner.options import SearchOptions, Training
from planner.plan.sections import Candidate, dp_mode_suffix
from planner.search.robust import Sturdiness
from planner.solve.problem import format_bytes
from planner.solve.step_problem import StepSolution

__all__ = ["best_note", "fewer_processes", "nothing_fits", "nothing_possible", "plan_warnings"]


def plan_warnings(
    layout: Layout, sol: StepSolution, prediction: Prediction, options: SearchOptions
) -> list[str]:
    """The chosen plan's performance hazards: a large bubble, a solve cut short, a stage
    near full. (A bounded placement is not one: the report's solver line gives its gap.)"""
    out = []
    lay = layout
    if lay.pp > 1 and lay.micro_batches < lay.pp:
        m = lay.micro_batches
        out.append(
            f"{m} micro-batch{'es' if m != 1 else ''} for {lay.pp} stages: the pipeline bubble "
            f"is {prediction.bubble_fraction:.0%} of the step (stages idle while the "
            f"pipeline fills and drains); at least {lay.pp} micro-batches "
            f"(--micro-batches {lay.pp}, with a batch divisible by dp × {lay.pp} = "
            f"{lay.dp * lay.pp}) would shrink it"
        )
    if sol.status == "time_limit":
        out.append(
            f"the solver stopped at its time limit ({options.time_limit_s} s) before proving "
            f"the placement optimal: its step {sol.step:.4g} ms is proven within "
            f"{sol.gap:.2%} of the best possible (≥ {sol.bound:.4g} ms); raise --time-limit "
            "for a proof"
        )
    elif sol.status == "bounded" and sol.method == "bounds" and sol.gap > 0:
        out.append(
            f"the placement is not proven optimal: its step {sol.step:.4g} ms is proven within "
            f"{sol.gap:.2%} of the best possible (≥ {sol.bound:.4g} ms) by the segment bounds, "
            f"and {sol.detail}; a larger --time-limit builds it"
        )
    elif sol.status == "bounded" and sol.method == "milp":
        out.append(
            f"the solver ended without proving the placement optimal ({sol.detail}): its step "
            f"{sol.step:.4g} ms is proven within {sol.gap:.2%} of the best possible; try "
            f"--solver {'cbc' if sol.solver == 'highs' else 'highs'}"
        )
    for st in prediction.stages:
        if st.memory.total > 0.9 * st.capacity:
            out.append(
                f"stage {st.index} uses {st.memory.total / 2**30:.2f} GiB of "
                f"{st.capacity / 2**30:.2f} GiB usable: little room for fragmentation"
            )
    return out


def best_note(solved: Sequence[Sturdiness]) -> str:
    """ "best pp 2 × dp 4, m 8, 1f1b: 12.3 ms": the fastest of ``solved``, for the search's
    progress; "" if none."""
    if not solved:
        return ""
    f = min(solved, key=lambda f: f.step_ms)
    return f"best {f.name()}: {f.step_ms:.1f} ms"


def fewer_processes(used: Cluster, given: Cluster) -> list[str]:
    """A note when the plan runs on fewer local CPU processes than were given (or with other
    threads): [Note: fewer CPU processes]."""
    n, k = given.n_devices, used.n_devices
    t0, t = given.devices[0].threads, used.devices[0].threads
    if (n, t0) == (k, t):
        return []
    return [
        f"runs {k} of the {n} CPU processes given, {t} torch thread{'s' if t != 1 else ''} "
        f"each (given: {t0}): they share this machine's {given.cores_per_node} cores, and "
        f"this is the fastest predicted split of them (the candidates say by how much); pin "
        f"--pp and --dp to use more"
    ]


def nothing_possible(
    training: Training, cluster: Cluster, options: SearchOptions, rejected: list[tuple[str, str]]
) -> str:
    """What was rejected and why, then the fixes for those reasons."""
    lines = "\n".join(f"  {why}" for why in dict.fromkeys(why for why, _ in rejected))
    fixes = list(dict.fromkeys(fix for _, fix in rejected))
    fix = "; or ".join(fixes) or "unpin --pp/--dp/--micro-batches/--schedule"
    return (
        f"no configuration is possible for batch {training.global_batch} on "
        f"{cluster.n_devices} devices:\n{lines}\n"
        f"Fix: {fix}."
    )


def nothing_fits(
    tried: Sequence[Candidate],
    oom_costs: list[CostModel],
    cluster: Cluster,
    training: Training,
    options: SearchOptions,
) -> str:
    """Why every candidate failed: memory per stage against capacity, or the time limit."""
    failed = [c for c in tried if c.status in ("out_of_memory", "timeout")]
    oom = [c for c in failed if c.status == "out_of_memory"]
    lines = [
        f"  pp {c.pp} × dp {c.dp}{dp_mode_suffix(c.dp_mode)}, {c.micro_batches} micro-batch"
        f"{'es' if c.micro_batches != 1 else ''} ({c.schedule}), {c.reason}"
        for c in failed[: options.keep]
    ]
    if len(failed) > options.keep:
        lines.append(f"  (+{len(failed) - options.keep} more)")
    if not oom:
        shown = ", ".join(
            f"pp {c.pp} × dp {c.dp} × m {c.micro_batches} {c.schedule}" for c in failed[:4]
        )
        more = f" and {len(failed) - 4} more" if len(failed) > 4 else ""
        return (
            f"no placement found in time: for every candidate ({len(failed)}: {shown}{more}) "
            f"the solver's time limit ({options.time_limit_s} s per solve) ran out before even "
            "its heuristic found a placement.\n"
            "Fix: raise --time-limit (default 60 s)."
        )
    head = (
        f"no configuration fits in memory: {len(oom)} of {len(failed)} candidate(s) ran out "
        f"of memory{', the others out of time' if len(oom) < len(failed) else ''}.\n"
    )
    return (
        head
        + "\n".join(lines)
        + "\n"
        + _memory_summary(oom_costs, cluster, training)
        + "Fix: more devices or devices with more memory (--gpus, a cluster file), fewer "
        "samples per micro-batch (more --micro-batches or a smaller --batch-size), "
        "--precision bf16-mixed, "
        + _SHARDING.get(options.dp_mode, "")
        + "or --optimizer sgd (less state per parameter). "
        + "Activation recompute was already tried for every stage."
    )


_SHARDING = {
    "ddp": "--dp-mode auto (ZeRO-1: replicas share the optimizer state out; FSDP: the weights "
    "and gradients too), ",
    "zero1": "--dp-mode fsdp or auto (FSDP: replicas share the weights and gradients out too), ",
}
"""The out-of-memory fix a dp mode leaves untried: sharding more (none after fsdp, auto)."""


def _memory_summary(costs: list[CostModel], cluster: Cluster, training: Training) -> str:
    """The largest block and the whole model's state, against the devices' memory."""
    if not costs:
        return ""
    # The deepest pipeline with the smallest micro-batches: the most favourable memory.
    cost = max(costs, key=lambda c: (c.layout.pp, -c.micro_batch_size))
    s, n = cost.layout.pp - 1, cost.n_blocks
    names = [b.name for b in cost.profile.blocks]

    def need(i: int, j: int) -> float:
        return min(cost.memory(s, i, j).total, cost.memory(s, i, j, True).total)

    k = max(range(n), key=lambda i: need(i, i + 1))
    big = min((cost.memory(s, k, k + 1), cost.memory(s, k, k + 1, True)), key=lambda m: m.total)
    whole = cost.memory(s, 0, n)
    state = whole.params + whole.grads + whole.optimizer
    usable = 1 - training.memory_headroom
    per_device = sorted({d.device.memory_bytes * usable for d in cluster.devices})
    device_text = " to ".join(
        dict.fromkeys(format_bytes(x) for x in (per_device[0], per_device[-1]))
    )
    total = sum(d.device.memory_bytes for d in cluster.devices) * usable
    return (
        f"The largest block is block {k} ({names[k]!r}): alone on a stage it needs "
        f"{format_bytes(need(k, k + 1))} (parameters, gradients and optimizer state "
        f"{format_bytes(big.params + big.grads + big.optimizer)}, activations "
        f"{format_bytes(big.activations)} at {cost.micro_batch_size} sample(s) per micro-batch) "
        f"against {device_text} usable per device "
        f"({training.memory_headroom:.0%} kept free).\n"
        f"All {n} blocks hold {format_bytes(state)} of parameters, gradients and optimizer "
        f"state ({training.optimizer}, {training.precision}); the {cluster.n_devices} devices "
        f"hold {format_bytes(total)} usable in all.\n"
    )
