"""The step problem: place a chain of blocks on stages so that a step's graph runs shortest.

A placement gives every stage a run of blocks; each run has *figures* (a
stage's forward, backward, all-reduce, tail, ... per micro-batch) and each
split point has *link figures* (the transfers across it). A step is a graph
of nodes whose durations are sums of those figures (for a pipeline: its
actions, transfers and tails); its time is the longest path through the
graph. :func:`planner.solve.step.solve_step` finds the placement whose step
is shortest, and proves it.

Two kinds of problem:

* **exact** (``exact=True``): the longest path *is* the step
  (``evaluate``), e.g. devices that do not share a machine. The MILP's
  optimum is then the step's optimum.
* **bounded**: the graph's longest path is only a lower bound on the step
  (e.g. processes sharing a machine's cores run slower when several compute
  at once). The solver proves a bound, searches for the best placement it
  can, and says how far apart the two are.

Pure: numbers and callables in. It imports nothing of the planner.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from planner.solve.problem import SegFn

__all__ = [
    "GraphNode",
    "Row",
    "SegBound",
    "StepProblem",
    "StepSolution",
    "StepStatus",
    "Term",
]

Term = tuple[int, int, float]
"""(stage or link, figure index, coefficient): one figure of a node's duration."""

StepStatus = Literal["optimal", "bounded", "time_limit"]

SegBound = Callable[[int, int, int, float], float]
"""(s, i, j, limit) -> a lower bound on the step of every placement that fits memory, in
which stage s holds blocks [i, j) and whose step is at most ``limit`` (any number above ``limit``
when there is none): a bound that needs to hold only where a placement could still
beat ``limit`` can leave the rest of the chain's placements out of its reckoning."""


@dataclass(frozen=True)
class GraphNode:
    """A node of the step's graph: it starts when every ``pred`` has ended.

    Attributes:
        preds: indices of the nodes it waits for (each before it).
        seg: stage figures its duration is made of.
        cut: link figures its duration is made of (link s joins stages s, s+1).
    """

    preds: tuple[int, ...]
    seg: tuple[Term, ...] = ()
    cut: tuple[Term, ...] = ()


@dataclass(frozen=True)
class Row:
    """Another lower bound on the step: ``T ≥ Σ seg + Σ cut + constant``."""

    seg: tuple[Term, ...] = ()
    cut: tuple[Term, ...] = ()
    constant: float = 0.0


@dataclass(frozen=True, kw_only=True)
class StepProblem:
    """A chain of blocks to place on pipeline stages, priced by a step's graph.

    Attributes:
        n_blocks: blocks in the chain (≥ 1).
        n_stages: stages S (≥ 1); each gets ≥ 1 block, in order.
        seg_figures: (s, i, j) -> stage s's figures when it holds blocks [i, j)
            (every figure ≥ 0, non-decreasing in j and non-increasing in i).
        cut_figures: (s, j) -> the figures of link s → s+1 when stage s+1 starts
            at block j.
        seg_memory: (s, i, j) -> peak bytes of stage s holding [i, j).
        capacity: bytes each stage's device holds.
        nodes: the step's graph in topological order.
        ends: the nodes the step waits for: its time is the latest of their ends.
        evaluate: starts -> the step of that placement (what the plan reports).
        exact: whether the graph's longest path equals ``evaluate``.
        seg_bound: (s, i, j, limit) -> a lower bound on the step of every
            placement in which stage s holds [i, j) and whose step is at most
            ``limit`` (:data:`SegBound`; segments whose bound exceeds the best
            step found are dropped); None: no bound.
        seg_floor: (s, i, j) -> a lower bound on the step of every placement in
            which stage s holds [i, j), non-decreasing in j: a stage's runs from
            one start are tried only while it stays under the best step found.
        seg_memory_floor: (s, i, j) -> a lower bound on ``seg_memory``,
            non-decreasing in j: a stage's runs from one start are tried only
            while it fits the stage's capacity.
        rows: further lower bounds on the step, linear in the figures.
        allowed_starts: blocks where a stage may start (None: every block).
        stage_class: per stage a label; stages with equal labels have equal
            figures (memory is still asked per stage).
        block_names: per block, a name for messages.
        shared: groups of stages that run on one device (several stages per
            rank: Interleaved 1F1B, Looped BFS): a group's ``seg_memory`` adds
            up against the device's capacity (its stages' ``capacity``, equal).
            A stage in no group has its device alone. Empty: every stage alone.
    """

    n_blocks: int
    n_stages: int
    seg_figures: Callable[[int, int, int], Sequence[float]]
    cut_figures: Callable[[int, int], Sequence[float]]
    seg_memory: SegFn
    capacity: Sequence[float]
    nodes: Sequence[GraphNode]
    ends: Sequence[int]
    evaluate: Callable[[tuple[int, ...]], float]
    exact: bool = True
    seg_bound: SegBound | None = None
    seg_floor: SegFn | None = None
    seg_memory_floor: SegFn | None = None
    rows: Sequence[Row] = ()
    allowed_starts: frozenset[int] | None = None
    stage_class: Sequence[int] | None = None
    block_names: Sequence[str] | None = None
    shared: Sequence[tuple[int, ...]] = ()

    def __post_init__(self) -> None:
        for name in ("n_blocks", "n_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer ≥ 1 (got {value!r})")
        if len(self.capacity) != self.n_stages:
            raise ValueError(
                f"capacity has {len(self.capacity)} entries for {self.n_stages} stages"
            )
        for v, node in enumerate(self.nodes):
            if any(not 0 <= u < v for u in node.preds):
                raise ValueError(f"node {v} waits for {node.preds}: nodes must come in order")
        if not self.ends or any(not 0 <= v < len(self.nodes) for v in self.ends):
            raise ValueError(f"ends must name nodes of the graph (got {list(self.ends)})")
        if self.stage_class is not None and len(self.stage_class) != self.n_stages:
            raise ValueError(f"stage_class needs {self.n_stages} labels")
        if self.block_names is not None and len(self.block_names) != self.n_blocks:
            raise ValueError(f"block_names needs {self.n_blocks} names")
        seen: set[int] = set()
        for group in self.shared:
            if any(not 0 <= s < self.n_stages or s in seen for s in group):
                raise ValueError(f"shared groups must name distinct stages (got {self.shared})")
            seen.update(group)
            if len({self.capacity[s] for s in group}) > 1:
                raise ValueError(f"the stages of shared group {group} must have one capacity")


@dataclass(frozen=True, kw_only=True)
class StepSolution:
    """A placement, its step, and what is proven about it.

    Attributes:
        starts: first block of each stage; ``starts[0] == 0``.
        step: its step (``evaluate``): the number the plan prints.
        bound: a proven lower bound on the step of every placement.
        gap: (step − bound) / step.
        status: "optimal": no placement has a shorter step (within a relative
            1e-7); "bounded": the solve ended with the gap open (a bounded
            problem's search ran out of rounds, the MILP solver ended
            without a proof, or the MILP was too large for the time left and
            not built: ``detail`` says which); "time_limit": the limit
            stopped it.
        method: how: "milp" (the step MILP), "enumeration" (every placement
            left after pruning was evaluated), "bounds" (the segment bounds
            alone: the least over placements of their largest segment bound
            reaches the step, or no placement's bounds stay under the
            ``ceiling``), "bound+simulation" (a bounded
            problem: the MILP's bound, raised by evaluating the placements it
            could not rule out), "search" (a bounded problem searched only,
            ``prove=False``: no bound).
        solver, solve_s, solver_s: the MILP solver, the whole call's seconds,
            and those inside the solver.
        n_segments: candidate stages (binaries) after pruning.
        evaluated: placements evaluated.
        detail: the solver's own words, for the record.
    """

    starts: tuple[int, ...]
    step: float
    bound: float
    gap: float
    status: StepStatus
    method: str
    solver: str
    solve_s: float
    solver_s: float
    n_segments: int
    evaluated: int
    detail: str
