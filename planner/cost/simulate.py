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
replicas (DDP, ``reduce``) before its gradient goes back; after it, each stage
runs its tail (the tied weights' exchange, the optimizer step: ``sync``), and
the step ends when every stage has.

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

Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from planner.plan.schedule import schedule_actions
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
        join=inputs.join,
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
    join: Sequence[Sequence[int]] = (),
) -> Timeline:
    """Simulate one step.

    Example::

        tl = simulate(fwd=[1, 1], bwd=[2, 2], micro_batches=4)
        tl.step_ms      # 3·(1 + 2) + … : see planner.cost.step_time.closed_form

    Args:
        fwd, bwd: per stage, the time of one micro-batch's forward / backward
            when it computes alone.
        micro_batches: m.
        schedule: "gpipe" or "1f1b".
        link_fwd, link_bwd: per link s → s+1 (p − 1 of them), the time of one
            micro-batch's activation / gradient transfer. Default 0.
        sync: per stage, the tail after its last backward (tied exchange,
            optimizer step).
        speed: ``speed[k − 1]`` is the rate at which every computing stage
            progresses while k stages compute at once (1.0 = as fast as alone;
            see [Note: shared cores]). Default: 1.0 for every k.
        reduce: per stage, time added to its last backward before that
            backward's gradient goes back to the previous stage: DDP
            all-reduces the gradients inside the last backward, so each stage's
            all-reduce delays the stages before it.
        join: groups of stages whose ``sync`` starts together, once every
            member has finished its last backward (they all-reduce the
            gradients of tied weights, a collective).
    """
    p, m = len(fwd), micro_batches
    if len(bwd) != p or p < 1 or m < 1:
        raise ValueError(f"need p ≥ 1 stages with fwd and bwd each (got {len(fwd)}, {len(bwd)})")
    run = _Run(
        fwd=list(fwd),
        bwd=list(bwd),
        m=m,
        actions=schedule_actions(schedule, p, m),
        lf=_per(link_fwd, p - 1),
        lb=_per(link_bwd, p - 1),
        red=_per(reduce, p),
        rate=list(speed) if speed is not None else [1.0] * p,
    )
    sy = _per(sync, p)
    if len(run.lf) != p - 1 or len(run.lb) != p - 1 or len(sy) != p or len(run.red) != p:
        raise ValueError("link_fwd/link_bwd need p − 1 entries, sync and reduce p entries")
    if len(run.rate) != p or not all(r > 0 for r in run.rate):
        raise ValueError(f"speed needs p = {p} entries, each > 0 (got {run.rate})")
    if any(r != 1.0 for r in run.rate):
        run.event_driven()
    else:
        run.list_scheduled()
    if any(run.nxt[s] < len(run.actions[s]) for s in range(p)):
        raise AssertionError(f"schedule {schedule!r} deadlocked at {run.nxt}")
    step = run.tails(sy, join)
    run.events.sort(key=lambda e: (e.start, e.stage, e.kind))
    return Timeline(tuple(run.events), step, p, m, schedule)


def _per(values: Sequence[float] | None, n: int) -> list[float]:
    return list(values) if values is not None else [0.0] * n


class _Run:
    """The state of one simulation: when each stage and link is free, what has arrived."""

    def __init__(self, **kw: Any) -> None:
        self.fwd: list[float] = kw["fwd"]
        self.bwd: list[float] = kw["bwd"]
        self.m: int = kw["m"]
        self.actions: list[list[str]] = kw["actions"]
        self.lf: list[float] = kw["lf"]
        self.lb: list[float] = kw["lb"]
        self.red: list[float] = kw["red"]
        self.rate: list[float] = kw["rate"]
        self.p = p = len(self.fwd)
        self.done: dict[tuple[str, int, int], float] = {}  # (kind, stage, k) -> end time
        self.arrive: dict[tuple[str, int, int], float] = {}  # input of (kind, stage, k) at
        self.stage_free = [0.0] * p
        self.link_free_f = [0.0] * max(p - 1, 0)
        self.link_free_b = [0.0] * max(p - 1, 0)
        self.nxt = [0] * p
        self.events: list[Event] = []

    def work(self, s: int, act: str) -> float:
        return self.fwd[s] if act[0] == "F" else self.bwd[s]

    def ready(self, s: int) -> float | None:
        """When stage s's next action may start (None: its input is not yet scheduled)."""
        act = self.actions[s][self.nxt[s]]
        kind, k = act[0], int(act[1:])
        if kind == "F":
            return 0.0 if s == 0 else self.arrive.get(("F", s, k))
        if s == self.p - 1:
            return self.done.get(("F", s, k))
        return self.arrive.get(("B", s, k))

    def finish(self, s: int, act: str, start: float, end: float) -> None:
        """Record an action that ran [start, end), and the transfer it starts."""
        kind, k = act[0], int(act[1:])
        self.events.append(Event(s, kind, k, start, end))
        if self.nxt[s] == len(self.actions[s]) and self.red[s] > 0:  # the last backward
            self.events.append(Event(s, "sync", -1, end, end + self.red[s]))
            end += self.red[s]
        self.stage_free[s] = end
        self.done[(kind, s, k)] = end
        if kind == "F" and s < self.p - 1:
            t0 = max(end, self.link_free_f[s])
            t1 = self.link_free_f[s] = t0 + self.lf[s]
            if self.lf[s] > 0:
                self.events.append(Event(s, "send_F", k, t0, t1))
            self.arrive[("F", s + 1, k)] = t1
        elif kind == "B" and s > 0:
            t0 = max(end, self.link_free_b[s - 1])
            t1 = self.link_free_b[s - 1] = t0 + self.lb[s - 1]
            if self.lb[s - 1] > 0:
                self.events.append(Event(s, "send_B", k, t0, t1))
            self.arrive[("B", s - 1, k)] = t1

    def list_scheduled(self) -> None:
        """Stages that do not share a machine: each action starts once its stage is
        free and its input has arrived, and takes its own time (list scheduling, fast)."""
        remaining = sum(len(a) for a in self.actions)
        while remaining:
            progressed = False
            for s in range(self.p):
                if self.nxt[s] >= len(self.actions[s]):
                    continue
                t_in = self.ready(s)
                if t_in is None:
                    continue
                act = self.actions[s][self.nxt[s]]
                start = max(self.stage_free[s], t_in)
                self.nxt[s] += 1
                self.finish(s, act, start, start + self.work(s, act))
                remaining -= 1
                progressed = True
            if not progressed:
                break

    def event_driven(self) -> None:
        """The stages computing at once share the machine (``speed``), so an action's end
        depends on what else runs meanwhile."""
        running: dict[int, list[Any]] = {}  # stage -> [action, start, work left (ms alone)]
        now = 0.0
        while True:
            for s in range(self.p):
                if s in running or self.nxt[s] >= len(self.actions[s]):
                    continue
                t_in = self.ready(s)
                if t_in is not None and t_in <= now:
                    act = self.actions[s][self.nxt[s]]
                    running[s] = [act, now, self.work(s, act)]
                    self.nxt[s] += 1
            waiting = [
                t
                for s in range(self.p)
                if s not in running and self.nxt[s] < len(self.actions[s])
                for t in [self.ready(s)]
                if t is not None and t > now
            ]
            if not running:
                if not waiting:
                    return
                now = min(waiting)
                continue
            r = self.rate[len(running) - 1]
            step = min(w for _, _, w in running.values()) / r
            until = min([now + step, *waiting])
            for s, run in sorted(running.items()):
                run[2] -= (until - now) * r
                if until == now + step and run[2] <= 1e-12 * max(1.0, step * r):
                    self.finish(s, run[0], run[1], until)
                    del running[s]
            now = until

    def tails(self, sync: Sequence[float], join: Sequence[Sequence[int]]) -> float:
        """Run every stage's tail (joined groups together); the step's end."""
        begin = list(self.stage_free)
        for group in join:
            together = max(self.stage_free[s] for s in group)
            for s in group:
                begin[s] = together
        step = 0.0
        for s in range(self.p):
            end = begin[s]
            if sync[s] > 0:
                self.events.append(Event(s, "sync", -1, end, end + sync[s]))
            step = max(step, end + sync[s])
        return step
