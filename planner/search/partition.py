"""A layout's cost model as the solvers' problems: numbers in, no torch, no planner.

The solver (:mod:`planner.solve`) knows nothing of the planner; this is where
the cost model's figures become its callables: :func:`step_problem` (the
simulated step, the number a plan prints) and :func:`partition_problem` (the
closed form, solved first for a fast good placement to start from).
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.cost.model import CostModel
from planner.cost.segment_bound import SegmentBound
from planner.cost.step_graph import FIGURES, Node, step_graph
from planner.solve.problem import PartitionProblem
from planner.solve.step_problem import GraphNode, Row, StepProblem, Term

__all__ = ["CLOSED_FORM_MAX", "closed_form_pays", "partition_problem", "step_problem"]

CLOSED_FORM_MAX = 4096
"""Blocks × stages above which the step solver gets no warm start from the closed-form ILP.
Its placement never beat the others there: on synthetic LM chains (``python -m
bench.bench_scaling --point B D --limit 10``), with and without it, the plan's step and
proof were the same at every point measured (32–512 blocks on 8–512 H100s), and it cost a
configuration 2–21 s (128 blocks × 512 devices: search 29.5 s with it, 5.6 s without;
512 × 512: 58.9 s and 26.7 s, under load)."""

_SEG = {name: q for q, name in enumerate(FIGURES[:4])}  # fwd, bwd, reduce, tail
_CUT = {name: q for q, name in enumerate(FIGURES[4:])}  # link_fwd, link_bwd


def closed_form_pays(cost: CostModel) -> bool:
    """Whether the closed-form ILP's placement is worth solving for as a warm start
    (``CLOSED_FORM_MAX``)."""
    return cost.n_blocks * cost.layout.n_stages <= CLOSED_FORM_MAX


def partition_problem(
    cost: CostModel, allowed_starts: frozenset[int] | None = None, names: Sequence[str] = ()
) -> PartitionProblem:
    """The :class:`PartitionProblem` of ``cost``'s layout (the closed-form objective).

    Example::

        sol = solve_partition(partition_problem(cost, names=block_names))

    A stage that does not fit without recompute is costed with it
    (:meth:`CostModel.stage_work`), so the problem needs no recompute variable.
    Stages with the same device types, nodes and micro-batches in flight cost the
    same (``stage_class``), which the solver uses to price each segment once.
    """
    return PartitionProblem(
        n_blocks=cost.n_blocks,
        n_stages=cost.layout.n_stages,
        micro_batches=cost.layout.micro_batches,
        seg_work=cost.stage_work,
        seg_memory=cost.stage_memory,
        capacity=cost.capacity,
        cut_time=cost.cut_ms,
        seg_sync=cost.sync,
        allowed_starts=allowed_starts,
        stage_class=cost.stage_classes(),
        block_names=list(names) or None,
    )


def step_problem(
    cost: CostModel, allowed_starts: frozenset[int] | None = None, names: Sequence[str] = ()
) -> StepProblem:
    """The :class:`StepProblem` of ``cost``'s layout: the simulated step itself.

    Example::

        sol = solve_step(step_problem(cost), warm_starts=[starts])
        sol.step == cost.predict(sol.starts).step_ms

    The graph is the schedule's ([Note: the step graph]); its figures are the
    ones :meth:`CostModel.predict` simulates with. Where stages share a
    machine's cores ([Note: shared cores]) a compute runs at most at the
    fastest speed, so the figures at that speed give a lower bound only, and
    the machine computes at most ``R = max_k k · speed_k`` stage-alone
    milliseconds per millisecond: every micro-batch's work takes at least
    Σ m·(f + b) / R, after which stage 0 still all-reduces and steps (a row).
    """
    lay, n = cost.layout, cost.n_blocks
    graph = step_graph(lay.schedule, lay.n_stages, lay.micro_batches, lay.virtual)
    prices = _Prices(cost)
    legal = sorted(set(range(1, n) if allowed_starts is None else allowed_starts) - {0})
    on = lay.stage_ranks
    local = {s for s in range(lay.n_stages - 1) if on[s] == on[s + 1]}  # ZB-V, DualPipeV

    def cuts(s: int, j: int) -> tuple[float, float]:  # nothing sent within a rank
        return (0.0, 0.0) if s in local else prices.cuts(s, j)

    bound = SegmentBound(  # each stage's own figures, its recompute choice included
        n_stages=lay.n_stages,
        micro_batches=lay.micro_batches,
        schedule=lay.schedule,
        positions=[0, *legal, n],
        figures=prices.figures,
        cuts=cuts,
        floor=lambda s, i, j: prices.priced(s, i, j, False),
        fits=lambda s, i, j: prices.memory_floor(s, i, j) <= cost.capacity[s],
        virtual=lay.virtual,
    )
    return StepProblem(
        n_blocks=n,
        n_stages=lay.n_stages,
        seg_figures=prices.figures,
        cut_figures=prices.cuts,
        seg_memory=prices.memory,
        seg_memory_floor=prices.memory_floor,
        capacity=cost.capacity,
        nodes=[_node(node) for node in graph.nodes],
        ends=graph.tails,
        evaluate=cost.step_ms,
        exact=prices.exact,
        seg_bound=bound,
        seg_floor=prices.floor,
        rows=_throughput(cost, prices),
        allowed_starts=allowed_starts,
        stage_class=prices.classes,
        block_names=list(names) or None,
        shared=cost.rank_stages(),
    )


class _Prices:
    """A layout's figures as the step's graph takes them, each computed once.

    ``exact``: every stage computes at full speed, so the figures are the
    simulation's; else they are the simulation's at the fastest speed (a
    lower bound on each compute).
    """

    def __init__(self, cost: CostModel) -> None:
        self.cost, self.time = cost, cost.time
        self.fastest = max(self.time.speeds)
        self.exact = all(r == 1.0 for r in self.time.speeds)
        self.classes = cost.stage_classes()
        self.times = cost.time_classes()  # priced figures are shared wider than figures
        self._priced: dict[tuple[int, int, int, bool], tuple[float, float, float, float]] = {}
        self._cuts: dict[tuple[int, int], tuple[float, float]] = {}
        self._memory: dict[tuple[int, int, int], float] = {}
        self._recompute: dict[tuple[int, int, int], bool] = {}
        self._fits: dict[tuple[int, int, int], bool] = {}
        self._floors: dict[tuple[int, int, int], float] = {}
        lay = cost.layout
        heaviest: dict[tuple[int, bool], int] = {}  # (time class, n < m) -> its fullest stage
        for s in range(lay.n_stages):
            n, key = lay.in_flight(s), (self.times[s], lay.in_flight(s) < lay.micro_batches)
            if key not in heaviest or n > lay.in_flight(heaviest[key]):
                heaviest[key] = s
        self._heaviest: dict[int, list[int]] = {}
        for (tc, _), s in sorted(heaviest.items()):
            self._heaviest.setdefault(tc, []).append(s)

    def priced(self, s: int, i: int, j: int, rc: bool) -> tuple[float, float, float, float]:
        """(fwd, bwd, reduce, tail) of stage s holding [i, j), recomputing or not."""
        key = (self.times[s], i, j, rc)
        got = self._priced.get(key)
        if got is None:
            t = self.time
            scale = t.compute_scale * (1.0 if self.exact else self.fastest)
            red = t.reduce_ms(s, i, j)
            got = (t.fwd(s, i, j) / scale, t.bwd(s, i, j, rc) / scale, red, t.sync(s, i, j) - red)
            self._priced[key] = got
        return got

    def figures(self, s: int, i: int, j: int) -> tuple[float, float, float, float]:
        """The figures with the stage's own recompute choice (it depends on the stage's
        memory: equal for stages of one class)."""
        key = (self.classes[s], i, j)
        rc = self._recompute.get(key)
        if rc is None:
            roomy = self._roomy(self.times[s], i, j)
            rc = self._recompute[key] = False if roomy else self.cost.recompute(s, i, j)
        return self.priced(s, i, j, rc)

    def _roomy(self, tc: int, i: int, j: int) -> bool:
        """Whether blocks [i, j) fit every stage of time class ``tc`` without recompute.

        Those stages differ only in the micro-batches n they hold in flight, and a
        stage's peak grows with n among stages with n < m, and among those with n = m
        (which lack 1F1B's steady-state moment: [Note: the memory peak]): the stage
        holding the most of each group stands for it. Two memory peaks, not one per
        stage (1F1B on 64 stages: 64 in-flight counts)."""
        key = (tc, i, j)
        got = self._fits.get(key)
        if got is None:
            got = self._fits[key] = not any(
                self.cost.recompute(r, i, j) for r in self._heaviest[tc]
            )
        return got

    def floor(self, s: int, i: int, j: int) -> float:
        """m·(f + b) without recompute: stage s's own actions, one after another (a lower
        bound on the step, non-decreasing in j)."""
        f, b, _, _ = self.priced(s, i, j, False)
        return self.cost.layout.micro_batches * (f + b)

    def memory_floor(self, s: int, i: int, j: int) -> float:
        """:meth:`CostModel.memory_floor`, once per time class: it follows the stage's
        device types (its block table, its capacity) and not its micro-batches in flight."""
        key = (self.times[s], i, j)
        got = self._floors.get(key)
        if got is None:
            got = self._floors[key] = self.cost.memory_floor(s, i, j)
        return got

    def cuts(self, s: int, j: int) -> tuple[float, float]:
        got = self._cuts.get((s, j))
        if got is None:
            got = self._cuts[s, j] = self.time.cut(s, j)
        return got

    def memory(self, s: int, i: int, j: int) -> float:
        key = (self.classes[s], i, j)
        got = self._memory.get(key)
        if got is None:
            got = self._memory[key] = self.cost.stage_memory(s, i, j)
        return got


def _throughput(cost: CostModel, prices: _Prices) -> list[Row]:
    """Shared cores: T ≥ Σ m·(f + b) alone / R + stage 0's all-reduce and tail."""
    lay, speeds = cost.layout, cost.time.speeds
    if prices.exact or lay.pp == 1:
        return []
    R = max((k + 1) * r for k, r in enumerate(speeds))
    c = lay.micro_batches * prices.fastest / R
    work = tuple((s, _SEG[q], c) for s in range(lay.n_stages) for q in ("fwd", "bwd"))
    return [Row(seg=(*work, (0, _SEG["reduce"], 1.0), (0, _SEG["tail"], 1.0)))]


def _node(node: Node) -> GraphNode:
    """A step-graph node as the solver's: its figures as (stage or link, figure, coefficient):
    1, or for a split backward's part ½ of ``bwd`` (the simulator's default weight share,
    which the cost model's step inputs keep)."""
    share = 0.5 if node.part else 1.0
    seg: list[Term] = [(node.stage, _SEG[node.compute], share)] if node.compute else []
    cut: list[Term] = []
    for name, i in node.fixed:
        if name in _SEG:
            seg.append((i, _SEG[name], 1.0))
        else:
            cut.append((i, _CUT[name], 1.0))
    return GraphNode(preds=node.preds, seg=tuple(seg), cut=tuple(cut))
