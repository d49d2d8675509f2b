"""Discrete-event simulation of one training step of a pipeline schedule.

The schedule is data: per stage, an ordered list of actions such as ``F3`` (the
forward of micro-batch 3) or ``B0``. Each stage runs its actions one at a time
in that order; links are resources of their own (one transfer at a time per
direction); an action starts when its stage is free and its input has arrived::

    F(s, k) needs F(s−1, k) done + the forward transfer on link s−1 → s
    B(s, k) needs B(s+1, k) done + the backward transfer on link s+1 → s
               (the last stage: its own F(s, k))

After its last backward, each stage all-reduces its gradients across its
replicas (``sync``); the step ends when every stage has. For GPipe (p = 4,
m = 3; · = idle)::

    stage 0  F0 F1 F2 ·  ·  ·  ·  ·  ·  ·  B0 B1 B2
    stage 1  ·  F0 F1 F2 ·  ·  ·  ·  B0 B1 B2
    stage 2  ·  ·  F0 F1 F2 ·  B0 B1 B2
    stage 3  ·  ·  ·  F0 F1 F2 B0 B1 B2

1F1B keeps at most p − s micro-batches in flight on stage s: ``p − s − 1``
warm-up forwards, then one forward and one backward in turn, then the
remaining backwards.

[Note: shared cores] Stages that share a machine's cores (local CPU processes)
slow each other down: an action's time is its work alone divided by the
``speed`` of the moment, which depends on how many stages compute at once
(oversubscribed cores are time-sliced; memory bandwidth is shared). With 4
single-threaded processes on 2 cores (pp = 2, dp = 2), a fill or drain slot
runs at the speed of 2 processes, the steady state at that of 4. The
simulation is event-driven for this: the rate changes whenever a stage starts
or ends an action.

Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "SCHEDULES",
    "Event",
    "Timeline",
    "closed_form",
    "schedule_actions",
    "simulate",
]

SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Event:
    """One interval of the timeline (milliseconds from the step's start).

    ``kind`` is "F", "B" (compute on ``stage``), "send_F" / "send_B" (a transfer
    on the link leaving ``stage`` forward / backward) or "sync" (the gradient
    all-reduce).
    """

    stage: int
    kind: str
    micro_batch: int
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """The simulated step: its events and the resulting figures."""

    events: tuple[Event, ...]
    step_ms: float
    n_stages: int
    micro_batches: int
    schedule: str

    def busy_ms(self, stage: int) -> float:
        """Compute time of a stage (forward + backward)."""
        return sum(e.end - e.start for e in self.events if e.stage == stage and e.kind in "FB")

    @property
    def compute_ms(self) -> float:
        """When the last forward or backward ends (the step before the all-reduce)."""
        return max((e.end for e in self.events if e.kind in "FB"), default=0.0)

    @property
    def bubble_fraction(self) -> float:
        """Share of the stages' compute phase spent idle: 1 − Σ busy / (p · compute_ms).

        Idle time waiting on transfers counts as bubble; the final all-reduce does not.
        """
        span = self.compute_ms
        if span <= 0:
            return 0.0
        busy = sum(self.busy_ms(s) for s in range(self.n_stages))
        return max(0.0, 1.0 - busy / (self.n_stages * span))


def schedule_actions(schedule: str, n_stages: int, micro_batches: int) -> list[list[str]]:
    """Per stage, the ordered actions ("F0", "B0", ...) of one step.

    Example::

        >>> schedule_actions("1f1b", 2, 3)
        [['F0', 'F1', 'B0', 'F2', 'B1', 'B2'], ['F0', 'B0', 'F1', 'B1', 'F2', 'B2']]
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    p, m = n_stages, micro_batches
    out = []
    for s in range(p):
        if schedule == "gpipe":
            out.append([f"F{k}" for k in range(m)] + [f"B{k}" for k in range(m)])
            continue
        warm = min(p - s - 1, m)
        acts = [f"F{k}" for k in range(warm)]
        f, b = warm, 0
        while b < m:
            if f < m:
                acts.append(f"F{f}")
                f += 1
            acts.append(f"B{b}")
            b += 1
        out.append(acts)
    return out


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
        tl.step_ms      # 3·(1 + 2) + … : see closed_form

    Args:
        fwd, bwd: per stage, the time of one micro-batch's forward / backward
            when it computes alone.
        micro_batches: m.
        schedule: "gpipe" or "1f1b".
        link_fwd, link_bwd: per link s → s+1 (p − 1 of them), the time of one
            micro-batch's activation / gradient transfer. Default 0.
        sync: per stage, the gradient all-reduce after its last backward.
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
    lf = list(link_fwd) if link_fwd is not None else [0.0] * (p - 1)
    lb = list(link_bwd) if link_bwd is not None else [0.0] * (p - 1)
    sy = list(sync) if sync is not None else [0.0] * p
    rate = list(speed) if speed is not None else [1.0] * p
    red = list(reduce) if reduce is not None else [0.0] * p
    if len(lf) != p - 1 or len(lb) != p - 1 or len(sy) != p or len(red) != p:
        raise ValueError("link_fwd/link_bwd need p − 1 entries, sync and reduce p entries")
    if len(rate) != p or not all(r > 0 for r in rate):
        raise ValueError(f"speed needs p = {p} entries, each > 0 (got {rate})")
    actions = schedule_actions(schedule, p, m)

    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, k) -> end time
    arrive: dict[tuple[str, int, int], float] = {}  # input of (kind, stage, k) ready at
    stage_free = [0.0] * p
    link_free_f = [0.0] * max(p - 1, 0)
    link_free_b = [0.0] * max(p - 1, 0)
    nxt = [0] * p
    events: list[Event] = []

    def ready(s: int) -> float | None:
        """When stage s's next action may start (None: its input is not yet scheduled)."""
        act = actions[s][nxt[s]]
        kind, k = act[0], int(act[1:])
        if kind == "F":
            return 0.0 if s == 0 else arrive.get(("F", s, k))
        if s == p - 1:
            return done.get(("F", s, k))
        return arrive.get(("B", s, k))

    def finish(s: int, act: str, start: float, end: float) -> None:
        kind, k = act[0], int(act[1:])
        events.append(Event(s, kind, k, start, end))
        if nxt[s] == len(actions[s]) and red[s] > 0:  # the last backward all-reduces
            events.append(Event(s, "sync", -1, end, end + red[s]))
            end += red[s]
        stage_free[s] = end
        done[(kind, s, k)] = end
        if kind == "F" and s < p - 1:
            t0 = max(end, link_free_f[s])
            t1 = t0 + lf[s]
            link_free_f[s] = t1
            if lf[s] > 0:
                events.append(Event(s, "send_F", k, t0, t1))
            arrive[("F", s + 1, k)] = t1
        elif kind == "B" and s > 0:
            t0 = max(end, link_free_b[s - 1])
            t1 = t0 + lb[s - 1]
            link_free_b[s - 1] = t1
            if lb[s - 1] > 0:
                events.append(Event(s, "send_B", k, t0, t1))
            arrive[("B", s - 1, k)] = t1

    shared = any(r != 1.0 for r in rate)
    if not shared:
        # Stages that do not share a machine: each action starts once its stage is free
        # and its input has arrived, and takes its own time (list scheduling, fast).
        remaining = sum(len(a) for a in actions)
        while remaining:
            progressed = False
            for s in range(p):
                if nxt[s] >= len(actions[s]):
                    continue
                t_in = ready(s)
                if t_in is None:
                    continue
                act = actions[s][nxt[s]]
                start = max(stage_free[s], t_in)
                nxt[s] += 1
                finish(s, act, start, start + (fwd[s] if act[0] == "F" else bwd[s]))
                remaining -= 1
                progressed = True
            if not progressed:
                break
    # Event-driven: the stages computing at once share the machine (``speed``), so
    # an action's end depends on what else runs meanwhile. running: stage -> [action,
    # start, work left (ms alone)].
    running: dict[int, list] = {}
    now = 0.0
    while shared:
        for s in range(p):
            if s in running or nxt[s] >= len(actions[s]):
                continue
            t_in = ready(s)
            if t_in is not None and t_in <= now:
                act = actions[s][nxt[s]]
                running[s] = [act, now, fwd[s] if act[0] == "F" else bwd[s]]
                nxt[s] += 1
        waiting = [
            t
            for s in range(p)
            if s not in running and nxt[s] < len(actions[s])
            for t in [ready(s)]
            if t is not None and t > now
        ]
        if not running:
            if not waiting:
                break
            now = min(waiting)
            continue
        r = rate[len(running) - 1]
        step = min(w for _, _, w in running.values()) / r
        until = min([now + step, *waiting])
        for s, run in sorted(running.items()):
            run[2] -= (until - now) * r
            if until == now + step and run[2] <= 1e-12 * max(1.0, step * r):
                finish(s, run[0], run[1], until)
                del running[s]
        now = until
    if any(nxt[s] < len(actions[s]) for s in range(p)):
        raise AssertionError(f"schedule {schedule!r} deadlocked at {nxt}")

    begin = list(stage_free)
    for group in join:
        together = max(stage_free[s] for s in group)
        for s in group:
            begin[s] = together
    step = 0.0
    for s in range(p):
        end = begin[s]
        if sy[s] > 0:
            events.append(Event(s, "sync", -1, end, end + sy[s]))
        step = max(step, end + sy[s])
    events.sort(key=lambda e: (e.start, e.stage, e.kind))
    return Timeline(tuple(events), step, p, m, schedule)


def closed_form(
    *,
    fwd: Sequence[float],
    bwd: Sequence[float],
    micro_batches: int,
    schedule: str = "gpipe",
    link_fwd: Sequence[float] | None = None,
    link_bwd: Sequence[float] | None = None,
    sync: Sequence[float] | None = None,
    reduce: Sequence[float] | None = None,
) -> float:
    """The step time in closed form (what the ILP minimises).

    GPipe is a flow shop for the forwards, then one for the backwards::

        T = Σ f + Σ lf + (m−1)·max(f, lf) + Σ b + Σ lb + (m−1)·max(b, lb) + max_s sync_s

    1F1B: the bottleneck stage alternates one forward and one backward::

        T = Σ (f + b) + Σ (lf + lb) + (m−1)·max(f + b, lf + lb) + max_s sync_s

    The all-reduce term assumes no overlap with other stages' drain; the
    simulation credits that overlap, so it is ≤ this bound (equal when the
    first stage has the largest all-reduce). ``reduce`` (all-reduces inside
    the last backward) adds ``Σ reduce``: the last micro-batch's gradient
    waits for each stage's in turn.
    """
    p, m = len(fwd), micro_batches
    lf = list(link_fwd) if link_fwd is not None else [0.0] * (p - 1)
    lb = list(link_bwd) if link_bwd is not None else [0.0] * (p - 1)
    sy = (max(sync) if sync else 0.0) + (sum(reduce) if reduce else 0.0)
    if schedule == "gpipe":
        t_f = sum(fwd) + sum(lf) + (m - 1) * max([*fwd, *lf])
        t_b = sum(bwd) + sum(lb) + (m - 1) * max([*bwd, *lb])
        return t_f + t_b + sy
    if schedule == "1f1b":
        work = [f + b for f, b in zip(fwd, bwd, strict=True)]
        links = [a + b for a, b in zip(lf, lb, strict=True)]
        return sum(work) + sum(links) + (m - 1) * max([*work, *links]) + sy
    raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
