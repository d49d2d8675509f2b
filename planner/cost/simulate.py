"""Discrete-event simulation of one training step: the only producer of a step's timeline.

The schedule is data (:mod:`planner.plan.schedule`): per stage, an ordered list
of actions such as ``F3`` (the forward of micro-batch 3) or ``B0``. Each stage
runs its actions one at a time in that order; links are resources of their
own (one transfer at a time per direction); an action starts when its stage is
free and its input has arrived::

    F(s, k) needs F(s−1, k) done + the forward transfer on link s−1 → s
    B(s, k) needs B(s+1, k) done + the backward transfer on link s+1 → s
               (the last stage: its own F(s, k))

The last backward of a stage also all-reduces its gradients across its
replicas (DDP, ``reduce``) before its gradient goes back; once every stage's
last backward has ended, each stage runs its tail (the tied weights' exchange,
the agreement on the step, the optimizer step: ``sync``), and the step ends
when every stage has. These rules are the step's graph
([Note: the step graph] in :mod:`planner.cost.step_graph`); the simulation runs
it, node by node.

[Note: shared cores] Stages that share a machine's cores (local CPU processes)
slow each other down: an action's time is its work alone divided by the
``speed`` of the moment, which depends on how many stages compute at once
(oversubscribed cores are time-sliced; memory bandwidth is shared). With 4
single-threaded processes on 2 cores (pp = 2, dp = 2), a fill or drain slot
runs at the speed of 2 processes, the steady state at that of 4. The
simulation is event-driven for this: the rate changes whenever a stage starts
or ends an action.

A plan keeps the simulation's inputs (:class:`~planner.plan.schema.StepInputs`);
:func:`replay` runs them, so a report draws the very step the plan predicts.

Imports no torch (the schedule's order is torch's: :mod:`planner.plan.schedule`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from planner.cost.step_graph import Node, StepGraph, step_graph
from planner.plan.sections import StepInputs
from planner.plan.timeline import Event, Timeline

__all__ = ["replay", "simulate"]


def replay(inputs: StepInputs) -> Timeline:
    """The step a plan's simulation inputs give (what :class:`CostModel` predicted)."""
    return simulate(
        fwd=inputs.fwd_ms,
        bwd=inputs.bwd_ms,
        micro_batches=inputs.micro_batches,
        schedule=inputs.schedule,
        link_fwd=inputs.link_fwd_ms,
        link_bwd=inputs.link_bwd_ms,
        sync=inputs.tail_ms,
        speed=inputs.speed,
        reduce=inputs.reduce_ms,
        virtual=inputs.virtual,
        weight_share=inputs.weight_share or None,
    )


def simulate(
    *,
    fwd: Sequence[float],
    bwd: Sequence[float],
    micro_batches: int,
    schedule: str = "gpipe",
    link_fwd: Sequence[float] | None = None,
    link_bwd: Sequence[float] | None = None,
    sync: Sequence[float] | None = None,
    speed: Sequence[float] | None = None,
    reduce: Sequence[float] | None = None,
    virtual: int = 1,
    weight_share: Sequence[float] | None = None,
) -> Timeline:
    """Simulate one step.

    Example::

        tl = simulate(fwd=[1, 1], bwd=[2, 2], micro_batches=4)
        tl.step_ms      # 3·(1 + 2) + … : see planner.cost.step_time.closed_form

    Args:
        fwd, bwd: per stage, the time of one micro-batch's forward / backward
            when it computes alone.
        micro_batches: m.
        schedule: a name of :data:`~planner.plan.schedule.SIMULATED` ("gpipe",
            "1f1b", "interleaved-1f1b", ...).
        link_fwd, link_bwd: per link s → s+1 (p − 1 of them), the time of one
            micro-batch's activation / gradient transfer. Default 0.
        sync: per stage, the tail after every stage's last backward (tied
            exchange, agreement, optimizer step; FSDP's collectives).
        speed: ``speed[k − 1]`` is the rate at which every computing stage
            progresses while k stages compute at once (1.0 = as fast as alone;
            see [Note: shared cores]). Default: 1.0 for every k.
        reduce: per stage, time added to its last backward before that
            backward's gradient goes back to the previous stage: DDP
            all-reduces the gradients inside the last backward, so each stage's
            all-reduce delays the stages before it.
        virtual: stages per rank (p / virtual ranks; ``speed`` counts ranks).
        weight_share: per stage, the share of ``bwd`` the split backward's
            ``W`` computes (``I`` the rest). Default ½: a linear layer's two
            gradients cost a forward each (the profile does not measure it).
    """
    p, m = len(fwd), micro_batches
    if len(bwd) != p or p < 1 or m < 1:
        raise ValueError(f"need p ≥ 1 stages with fwd and bwd each (got {len(fwd)}, {len(bwd)})")
    values = {
        "fwd": list(fwd),
        "bwd": list(bwd),
        "reduce": _per(reduce, p),
        "tail": _per(sync, p),
        "link_fwd": _per(link_fwd, p - 1),
        "link_bwd": _per(link_bwd, p - 1),
    }
    sizes = [len(values[k]) for k in ("link_fwd", "link_bwd", "tail", "reduce")]
    if sizes != [p - 1, p - 1, p, p]:
        raise ValueError("link_fwd/link_bwd need p − 1 entries, sync and reduce p entries")
    values["weight_share"] = list(weight_share) if weight_share is not None else [0.5] * p
    if len(values["weight_share"]) != p or not all(0 <= w <= 1 for w in values["weight_share"]):
        raise ValueError(f"weight_share needs p = {p} entries in [0, 1]")
    ranks = p // virtual if virtual >= 1 and p % virtual == 0 else 0
    rate = list(speed) if speed is not None else [1.0] * ranks
    if not ranks or len(rate) != ranks or not all(r > 0 for r in rate):
        raise ValueError(
            f"speed needs one entry per rank ({p} stages / {virtual} per rank), each > 0 "
            f"(got {rate})"
        )
    graph = step_graph(schedule, p, m, virtual)
    if any(r != 1.0 for r in rate):
        times = _shared(graph, values, rate)
    else:
        times = longest_path(graph, values)
    events = _events(graph, values, times)
    step = max((times[t][2] for t in graph.tails), default=0.0)
    return Timeline(tuple(events), max(step, 0.0), p, m, schedule, ranks)


def _per(values: Sequence[float] | None, n: int) -> list[float]:
    return list(values) if values is not None else [0.0] * n


# Per node: (start, end of its compute, end).
Times = list[tuple[float, float, float]]


def _work(node: Node, values: Mapping[str, list[float]]) -> float:
    """A compute node's time alone: its figure, or a split backward's part of it."""
    work = values[node.compute][node.stage]
    if node.part:
        share = values["weight_share"][node.stage] if "weight_share" in values else 0.5
        work *= share if node.part == "weight" else 1.0 - share
    return work


def _fixed(node_fixed: tuple[tuple[str, int], ...], values: Mapping[str, list[float]]) -> float:
    return sum(values[name][i] for name, i in node_fixed)


def longest_path(graph: StepGraph, values: Mapping[str, list[float]]) -> Times:
    """Every stage at full speed: each node starts when its last input ends (list scheduling)."""
    times: Times = []
    for node in graph.nodes:
        start = 0.0
        for u in node.preds:
            start = max(start, times[u][2])
        done = start + _work(node, values) if node.compute else start
        end = done + _fixed(node.fixed, values) if node.fixed else done
        times.append((start, done, end))
    return times


def _shared(
    graph: StepGraph,
    values: Mapping[str, list[float]],
    rate: Sequence[float],
) -> Times:
    """The stages computing at once share the machine (``speed``), so a compute's end
    depends on what else runs meanwhile: an event-driven run of the graph."""
    nodes = graph.nodes
    times: list[tuple[float, float, float] | None] = [None] * len(nodes)
    left = [len(n.preds) for n in nodes]
    after: list[list[int]] = [[] for _ in nodes]
    for v, n in enumerate(nodes):
        for u in n.preds:
            after[u].append(v)
    pending: dict[int, float] = {}  # compute nodes whose inputs are known: when they may start
    running: dict[int, list[float]] = {}  # compute node -> [start, work left (ms alone)]

    def ends(v: int, start: float, done: float) -> None:
        times[v] = (start, done, done + _fixed(nodes[v].fixed, values))
        for w in after[v]:
            left[w] -= 1
            if left[w] == 0:
                ready(w)

    def ready(v: int) -> None:
        start = max((times[u][2] for u in nodes[v].preds), default=0.0)  # type: ignore[index]
        if nodes[v].compute:
            pending[v] = start
        else:
            ends(v, start, start)

    for v in range(len(nodes)):
        if left[v] == 0:
            ready(v)
    now = 0.0
    while pending or running:
        for v in sorted(v for v, t in pending.items() if t <= now):
            del pending[v]
            running[v] = [now, _work(nodes[v], values)]
        waiting = [t for t in pending.values() if t > now]
        if not running:
            now = min(waiting)
            continue
        r = rate[len(running) - 1]
        step = min(w for _, w in running.values()) / r
        until = min([now + step, *waiting])
        finished = []
        for v, run in sorted(running.items()):
            run[1] -= (until - now) * r
            if until == now + step and run[1] <= 1e-12 * max(1.0, step * r):
                finished.append(v)
        now = until
        for v in finished:
            start = running.pop(v)[0]
            ends(v, start, now)
    if any(t is None for t in times):
        raise AssertionError("the step graph deadlocked")
    return times  # type: ignore[return-value]


def _events(graph: StepGraph, values: Mapping[str, list[float]], times: Times) -> list[Event]:
    """The timeline's events: computes, the all-reduce after a last backward, sends, tails."""
    events = []
    for node, (start, done, end) in zip(graph.nodes, times, strict=True):
        s, k = node.stage, node.micro_batch
        if node.compute:
            events.append(Event(s, node.kind, k, start, done))
            if end > done:  # the last backward's all-reduce
                events.append(Event(s, "reduce", -1, done, end))
        elif end > start:
            events.append(Event(s, node.kind, k, start, end))
    events.sort(key=lambda e: (e.start, e.stage, e.kind))
    return events
