"""The pipeline schedules as data: each rank's ordered actions in one step, as torch runs them.

An action is one compute of one stage on one micro-batch: ``F`` (forward),
``B`` (full backward), or, for the zero-bubble schedules, ``I`` (the backward
for the stage's input) and ``W`` (the backward for its weights, deferred to
fill bubbles). Written like torch's pipelining prints them: ``2F0`` is stage
2's forward of micro-batch 0. GPipe (p = 4 stages, m = 3 micro-batches;
· = idle)::

    rank 0  F0 F1 F2 ·  ·  ·  ·  ·  ·  ·  B0 B1 B2
    rank 1  ·  F0 F1 F2 ·  ·  ·  ·  B0 B1 B2
    rank 2  ·  ·  F0 F1 F2 ·  B0 B1 B2
    rank 3  ·  ·  ·  F0 F1 F2 B0 B1 B2

1F1B keeps at most p − s micro-batches in flight on stage s: ``p − s − 1``
warm-up forwards, then one forward and one backward in turn, then the
remaining backwards.

[Note: the order is torch's] What the simulator prices is the order the
runtime executes. torch's multi-stage schedules (``_PipelineScheduleRuntime``)
execute their ``pipeline_order`` action by action: that order is taken from
the class itself, built over stand-in stages that carry only the stage and
rank numbers (:func:`rank_actions`; cached), not re-derived here. Its
single-stage classes (GPipe, 1F1B) run hand-written loops instead, and their
``pipeline_order`` is not what those loops run (torch 2.13's 1F1B one skips
the last stage's micro-batch 0 and adds a micro-batch m): for these two the
order is written out below, as the loops run it (a test runs torch's loop on
a recording stand-in stage and compares). Schedules with several stages per
rank (``v`` virtual stages: Interleaved 1F1B, Looped BFS, the zero-bubble
ones; Interleaved ZB at v = 1 is the zero-bubble paper's ZB-1p) place stage
``i`` on rank ``i mod pp`` ("loop"), or, for the V schedules (ZB-V,
DualPipeV), down the ranks and back up ("v": stages 0 and 2·pp − 1 on rank
0). DualPipeV's overlapped forward-backward pairs are taken as their two
parts in order (the overlap itself is not priced).

``SCHEDULES`` (one stage per rank) and ``MULTI_STAGE`` (several) are those the
planner searches and the runtime runs; ``SIMULATED`` adds those the simulator
prices so far.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import NamedTuple

__all__ = [
    "MULTI_STAGE",
    "SCHEDULES",
    "SIMULATED",
    "SPLIT_BACKWARD",
    "V_SHAPED",
    "Action",
    "check_schedule",
    "held_at_peak",
    "in_flight",
    "rank_actions",
    "schedule_actions",
    "schedule_problem",
    "stage_ranks",
]

SCHEDULES = ("gpipe", "1f1b")
"""The one-stage-per-rank schedules the planner searches and the runtime runs."""

MULTI_STAGE = ("interleaved-1f1b", "looped-bfs", "interleaved-zb", "zbv", "dualpipev")
"""The schedules of several stages per rank the planner searches and the runtime runs:
Interleaved 1F1B, Looped BFS and Interleaved ZB at v ≥ 2 (stage i on rank i mod pp;
Interleaved ZB also at v = 1, the zero-bubble paper's ZB-1p, when pinned), ZB-V and
DualPipeV at v = 2 (stages down the ranks and back up)."""

SIMULATED: dict[str, tuple[str, str]] = {
    "gpipe": ("ScheduleGPipe", "loop"),
    "1f1b": ("Schedule1F1B", "loop"),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", "loop"),
    "looped-bfs": ("ScheduleLoopedBFS", "loop"),
    "interleaved-zb": ("ScheduleInterleavedZeroBubble", "loop"),
    "zbv": ("ScheduleZBVZeroBubble", "v"),
    "dualpipev": ("ScheduleDualPipeV", "v"),
}
"""Every schedule the simulator prices: name → (torch's class, how stages sit on ranks)."""

SPLIT_BACKWARD = ("interleaved-zb", "zbv", "dualpipev")
"""The zero-bubble schedules: each backward split into the input's part (``I``) and the
weights' (``W``, later)."""

_SINGLE = ("gpipe", "1f1b")  # one stage per rank
V_SHAPED = ("zbv", "dualpipev")
"""The schedules of exactly two stages per rank, down the ranks and back up."""


class Action(NamedTuple):
    """One compute: ``kind`` ("F", "B", "I" or "W") of ``stage`` on ``micro_batch``."""

    kind: str
    stage: int
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.micro_batch}"


def schedule_problem(
    schedule: str, stages: int, micro_batches: int, virtual: int = 1
) -> tuple[str, str] | None:
    """Why ``schedule`` cannot run ``micro_batches`` through ``stages`` ranks of ``virtual``
    stages each (why, fix), or None.

    >>> schedule_problem("1f1b", 4, 2)[0]
    '1f1b needs micro-batches ≥ stages (m 2 < pp 4)'
    """
    p, m, v = stages, micro_batches, virtual
    if schedule not in SIMULATED:
        return (f"unknown schedule {schedule!r}", f"choose one of {', '.join(SIMULATED)}")
    if schedule in _SINGLE and v != 1:
        return (f"{schedule} runs one stage per rank (v {v})", "layout.virtual: 1")
    if schedule in V_SHAPED and v != 2:
        return (f"{schedule} runs exactly two stages per rank (v {v})", "layout.virtual: 2")
    if schedule not in _SINGLE and schedule not in V_SHAPED and v < 1:
        return (f"{schedule} needs v ≥ 1 stages per rank (v {v})", "layout.virtual: 2")
    if schedule == "1f1b" and m < p:
        # torch's Schedule1F1B needs a micro-batch per stage in flight.
        return (
            f"1f1b needs micro-batches ≥ stages (m {m} < pp {p})",
            f"--schedule gpipe, or --micro-batches {p} or more",
        )
    if schedule == "dualpipev" and m < 2 * p:
        return (
            f"dualpipev needs micro-batches ≥ its 2·pp stages (m {m} < {2 * p})",
            f"--micro-batches {2 * p} or more",
        )
    if schedule in ("interleaved-1f1b", "interleaved-zb"):
        rounds = max(1, m // p)
        if m % rounds:
            # torch: the micro-batches go in rounds of m // rounds, all rounds equal.
            return (
                f"{schedule} needs m a multiple of its rounds max(1, m // pp) "
                f"(m {m}, pp {p}: {rounds} rounds)",
                f"--micro-batches {p * rounds} (or any multiple of pp)",
            )
    return None


def check_schedule(schedule: str, stages: int, micro_batches: int, virtual: int = 1) -> None:
    """Raise ``ValueError`` (why and fix) when :func:`schedule_problem` finds one."""
    problem = schedule_problem(schedule, stages, micro_batches, virtual)
    if problem is not None:
        why, fix = problem
        raise ValueError(f"{why}; fix: {fix}")


def stage_ranks(schedule: str, ranks: int, virtual: int = 1) -> tuple[int, ...]:
    """The rank each of the ``ranks · virtual`` stages runs on.

    >>> stage_ranks("interleaved-1f1b", 2, 2), stage_ranks("zbv", 2, 2)
    ((0, 1, 0, 1), (0, 1, 1, 0))
    """
    style = SIMULATED[schedule][1] if schedule in SIMULATED else "loop"
    out = []
    for s in range(ranks * virtual):
        lap, at = divmod(s, ranks)
        out.append(ranks - 1 - at if style == "v" and lap % 2 else at)
    return tuple(out)


@functools.lru_cache(maxsize=64)
def rank_actions(
    schedule: str, ranks: int, micro_batches: int, virtual: int = 1
) -> tuple[tuple[Action, ...], ...]:
    """Per rank, its computes in the order torch's schedule class runs them
    ([Note: the order is torch's]).

    Example::

        >>> [str(a) for a in rank_actions("interleaved-1f1b", 2, 2, 2)[1]]
        ['1F0', '1F1', '3F0', '3B0', '3F1', '3B1', '1B0', '1B1']
    """
    if schedule in _SINGLE and virtual == 1:  # priced for any m (the runtime refuses 1f1b's m < p)
        return tuple(
            tuple(Action(a[0], s, int(a[1:])) for a in _single(schedule, ranks, micro_batches, s))
            for s in range(ranks)
        )
    check_schedule(schedule, ranks, micro_batches, virtual)
    from torch.distributed.pipelining import schedules as torch_schedules

    cls = getattr(torch_schedules, SIMULATED[schedule][0])
    n = ranks * virtual
    on = stage_ranks(schedule, ranks, virtual)
    mine = [s for s in range(n) if on[s] == 0]
    stand_ins = [
        SimpleNamespace(stage_index=s, num_stages=n, group_size=ranks, group_rank=0, submod=None)
        for s in mine
    ]
    order = cls(stand_ins, n_microbatches=micro_batches).pipeline_order
    return tuple(tuple(_computes(order[r])) for r in range(ranks))


def _single(schedule: str, p: int, m: int, s: int) -> list[str]:
    """Stage ``s``'s order in torch's GPipe / 1F1B loop: all forwards then all
    backwards; or ``p − s`` forwards, then a backward and a forward in turn."""
    if schedule == "gpipe":
        return [f"F{k}" for k in range(m)] + [f"B{k}" for k in range(m)]
    warm = min(p - s - 1, m)
    acts = [f"F{k}" for k in range(warm)]
    f, b = warm, 0
    while b < m:
        if f < m:
            acts.append(f"F{f}")
            f += 1
        acts.append(f"B{b}")
        b += 1
    return acts


def _computes(actions: list) -> list[Action]:
    """torch's actions of one rank as :class:`Action` (idle slots and gradient
    reductions dropped, an overlapped pair split into its parts)."""
    out: list[Action] = []
    for a in actions:
        if a is None:
            continue
        kind = a.computation_type.value
        if a.sub_actions:
            out.extend(_computes(list(a.sub_actions)))
        elif kind in ("F", "B", "I", "W"):
            out.append(Action(kind, a.stage_index, a.microbatch_index))
    return out


def in_flight(schedule: str, pp: int, micro_batches: int, stage: int, virtual: int = 1) -> int:
    """Micro-batches whose activations ``stage`` holds at its peak: all ``m`` in
    GPipe, at most ``p − s`` in 1F1B; for the other schedules, read from the order
    (:func:`held_at_peak`).

    >>> in_flight("1f1b", 4, 8, 1), in_flight("gpipe", 4, 8, 1)
    (3, 8)
    """
    if schedule == "1f1b" and virtual == 1:
        return min(micro_batches, pp - stage)
    if schedule == "gpipe" and virtual == 1:
        return micro_batches
    return held_at_peak(schedule, pp, micro_batches, stage, virtual)


@functools.lru_cache(maxsize=4096)
def held_at_peak(schedule: str, pp: int, micro_batches: int, stage: int, virtual: int = 1) -> int:
    """The most micro-batches ``stage`` has run forward and not yet backward (``B``, or
    ``W`` where the backward is split: the weights' part still needs its inputs),
    over its rank's order (``pp`` ranks of ``virtual`` stages each)."""
    rank = stage_ranks(schedule, pp, virtual)[stage]
    held = peak = 0
    for a in rank_actions(schedule, pp, micro_batches, virtual)[rank]:
        if a.stage == stage:
            held += 1 if a.kind == "F" else -1 if a.kind in ("B", "W") else 0
            peak = max(peak, held)
    return peak


def schedule_actions(schedule: str, n_stages: int, micro_batches: int) -> list[list[str]]:
    """Per stage of a one-stage-per-rank schedule, its ordered actions ("F0", "B0", ...).

    Example::

        >>> schedule_actions("1f1b", 2, 3)
        [['F0', 'F1', 'B0', 'F2', 'B1', 'B2'], ['F0', 'B0', 'F1', 'B1', 'F2', 'B2']]
    """
    if schedule not in _SINGLE:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(_SINGLE)}")
    acts = rank_actions(schedule, n_stages, micro_batches)
    return [[f"{a.kind}{a.micro_batch}" for a in rank] for rank in acts]
