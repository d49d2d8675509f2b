"""The cost model: the one place that turns a placement into predicted time and memory.

:class:`CostModel` prices placements of one layout: per segment (a stage
holding a run of blocks) the work, memory, transfers and tail the partition
solver needs, and per placement the predicted step (:meth:`CostModel.predict`):
each stage's figures, and the simulation of the schedule, whose inputs the
prediction keeps (:class:`~planner.plan.schema.StepInputs`) so that a plan and
its reports replay the same step. The figures themselves come from
``stage_time`` and ``stage_memory``, over the tables of ``basis``.

Pure: no torch. Times in milliseconds, sizes in bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from planner.cost.basis import CostBasis, Layout
from planner.cost.simulate import replay
from planner.cost.stage_memory import MemoryBreakdown, StageMemoryModel
from planner.cost.stage_time import StageTime
from planner.cost.step_time import closed_form
from planner.devices.cluster import Cluster
from planner.options import Training
from planner.plan.records import ModelProfile
from planner.plan.schedule import SCHEDULES
from planner.plan.sections import StepInputs
from planner.plan.timeline import Timeline

__all__ = ["CostModel", "Prediction", "StagePrediction"]


@dataclass(frozen=True, kw_only=True)
class StagePrediction:
    """One stage's predicted figures (times per micro-batch, all stages computing)."""

    index: int
    blocks: tuple[int, int]
    device: str
    fwd_ms: float
    bwd_ms: float
    recompute: bool
    send_fwd_ms: float
    send_bwd_ms: float
    sync_ms: float
    memory: MemoryBreakdown
    capacity: float


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """The predicted step of a placement: its stages, the simulation's inputs and timeline."""

    stages: tuple[StagePrediction, ...]
    step_ms: float
    closed_form_ms: float
    bubble_fraction: float
    samples_per_s: float
    inputs: StepInputs
    timeline: Timeline
    stage_ranks: tuple[int, ...] = ()
    rank_memory: tuple[float, ...] = ()
    """With several stages per rank: per stage its pipeline rank, and per pipeline rank
    the peak bytes of its stages together (each stage's peak, summed: an upper bound)."""

    @property
    def fits(self) -> bool:
        """Every device holds its stages: with several stages per rank (``rank_memory``),
        their sum."""
        if not self.rank_memory:
            return all(s.memory.total <= s.capacity for s in self.stages)
        caps: dict[int, float] = {}
        for s, r in zip(self.stages, self.stage_ranks, strict=True):
            caps[r] = s.capacity
        return all(total <= caps[r] for r, total in enumerate(self.rank_memory))


class CostModel:
    """Costs of placements for one layout.

    Example::

        cm = CostModel({"cpu": prof}, cluster, Training(global_batch=32), layout)
        cm.stage_work(0, 0, 5), cm.memory(0, 0, 5).total   # one segment
        pred = cm.predict((0, 5, 11))                      # a placement's step

    Args:
        profiles: per device type (catalogue key), the model's profile at this
            layout's micro-batch size.
        cluster, training, layout: as named.

    Attributes:
        basis: the layout's tables (:class:`~planner.cost.basis.CostBasis`).
        time: every time figure (:class:`~planner.cost.stage_time.StageTime`).
        memory_model: every memory figure
            (:class:`~planner.cost.stage_memory.StageMemoryModel`).
    """

    def __init__(
        self,
        profiles: Mapping[str, ModelProfile],
        cluster: Cluster,
        training: Training,
        layout: Layout,
    ) -> None:
        self.basis = CostBasis(profiles, cluster, training, layout)
        self.time = StageTime(self.basis)
        self.memory_model = StageMemoryModel(self.basis)
        self._stages: dict[tuple[int, int, int], StagePrediction] = {}

    # ----------------------------------------------------------------- the layout

    @property
    def cluster(self) -> Cluster:
        return self.basis.cluster

    @property
    def training(self) -> Training:
        return self.basis.training

    @property
    def layout(self) -> Layout:
        return self.basis.layout

    @property
    def profile(self) -> ModelProfile:
        return self.basis.profile

    @property
    def n_blocks(self) -> int:
        return self.basis.n_blocks

    @property
    def micro_batch_size(self) -> int:
        return self.basis.micro_batch_size

    @property
    def capacity(self) -> list[float]:
        """Usable bytes per device of each stage (the headroom kept free)."""
        return self.basis.capacity

    # ----------------------------------------------------------------- segments

    def memory(self, s: int, i: int, j: int, recompute: bool = False) -> MemoryBreakdown:
        """The peak memory of stage s holding blocks [i, j) ([Note: the memory peak])."""
        return self.memory_model.peak(s, i, j, recompute)

    def recompute(self, s: int, i: int, j: int) -> bool:
        """Whether stage s holding blocks [i, j) recomputes its activations."""
        return self.memory_model.recompute(s, i, j)

    def stage_work(self, s: int, i: int, j: int) -> float:
        """Forward + backward of one micro-batch, recomputing where memory needs it.

        A stage that does not fit without recompute is costed with it: the
        cheaper choice that fits is always the right one for a single stage, so
        the solver never needs a recompute variable.
        """
        rc = self.recompute(s, i, j)
        return self.time.fwd(s, i, j) + self.time.bwd(s, i, j, rc)

    def stage_memory(self, s: int, i: int, j: int) -> float:
        """The peak bytes of the segment, with the recompute choice of :meth:`stage_work`."""
        return self.memory(s, i, j, self.recompute(s, i, j)).total

    def memory_floor(self, s: int, i: int, j: int) -> float:
        """A lower bound on :meth:`stage_memory`, non-decreasing in j (the weights, their
        gradients and optimizer state, buffers): a run longer than one that exceeds the
        device with these alone does too."""
        return self.memory_model.floor(s, i, j)

    def fits(self, starts: Sequence[int]) -> bool:
        """Whether the placement ``starts`` fits: every stage its device, and with several
        stages per rank, each rank's stages together (as :attr:`Prediction.fits`)."""
        bounds = self._bounds(starts)
        mem = [self.stage_memory(s, bounds[s], bounds[s + 1]) for s in range(len(starts))]
        if any(m > c for m, c in zip(mem, self.capacity, strict=True)):
            return False
        return all(sum(mem[s] for s in g) <= self.capacity[g[0]] for g in self.rank_stages())

    def rank_stages(self) -> tuple[tuple[int, ...], ...]:
        """Per pipeline rank, the stages it runs, when it runs several (v > 1); else ()."""
        if self.layout.virtual == 1:
            return ()
        on = self.layout.stage_ranks
        return tuple(tuple(s for s, r in enumerate(on) if r == k) for k in range(self.layout.pp))

    def cut_ms(self, s: int, j: int) -> float:
        """Both transfers per micro-batch on link s → s+1 when stage s+1 starts at block j."""
        f, b = self.time.cut(s, j)
        return f + b

    def sync(self, s: int, i: int, j: int) -> float:
        """The step's tail on stage s: all-reduce, tied exchange, optimizer step (ms)."""
        return self.time.sync(s, i, j)

    def time_classes(self) -> list[int]:
        """Per stage a label: stages with equal labels have equal times for every run of
        blocks (forward, backward at a given recompute choice, all-reduce, tail).

        Those follow the stage's device types, the kinds of device among its replicas
        (the optimizer step), and the ring its replicas all-reduce over, which is
        affine in the bytes: its time for 0 bytes and for 1 byte pins it. Equal
        nodes in other places of the cluster make equal stages (on 64 nodes of 8
        with pp 64, every stage of one class, not 64). The tied weights' exchange
        depends on where the other stages sit: with tied sets every stage is its own.
        """
        labels: dict[tuple[object, ...], int] = {}
        cluster, layout = self.cluster, self.layout
        out = []
        for s in range(layout.n_stages):
            ranks = layout.ranks[s]
            kinds = frozenset(
                (cluster.devices[r].device, cluster.devices[r].threads) for r in ranks
            )
            ring = (cluster.allreduce_time(ranks, 0.0), cluster.allreduce_time(ranks, 1.0))
            key = (tuple(self.basis.stage_types[s]), kinds, ring, s if self.basis.tied else -1)
            out.append(labels.setdefault(key, len(labels)))
        return out

    def stage_classes(self) -> list[int]:
        """Per stage a label: stages with equal labels have equal figures for every run of
        blocks, the recompute choice included. That choice follows the stage's memory,
        which also depends on the micro-batches it holds in flight (1F1B: ``pp − s``), so
        equal devices alone do not make equal figures."""
        labels: dict[tuple[int, int], int] = {}
        times = self.time_classes()
        return [
            labels.setdefault((times[s], self.layout.in_flight(s)), len(labels))
            for s in range(self.layout.n_stages)
        ]

    # ----------------------------------------------------------------- prediction

    def predict(self, starts: Sequence[int]) -> Prediction:
        """Per-stage figures and the simulated step of the placement ``starts``."""
        bounds = self._bounds(starts)
        n = self.layout.n_stages
        stages = tuple(self._stage(s, bounds[s], bounds[s + 1]) for s in range(n))
        inputs = self._inputs(stages, bounds)
        timeline = replay(inputs)
        step = timeline.step_ms
        closed = step  # a multi-stage schedule has no closed form: its simulation
        if self.layout.virtual == 1 and self.layout.schedule in SCHEDULES:
            closed = closed_form(
                fwd=[x.fwd_ms for x in stages],
                bwd=[x.bwd_ms for x in stages],
                micro_batches=self.layout.micro_batches,
                schedule=self.layout.schedule,
                link_fwd=[x.send_fwd_ms for x in stages[:-1]],
                link_bwd=[x.send_bwd_ms for x in stages[:-1]],
                sync=[x.sync_ms for x in stages],
            )
        return Prediction(
            stages=stages,
            step_ms=step,
            closed_form_ms=closed,
            bubble_fraction=timeline.bubble_fraction,
            samples_per_s=self.training.global_batch / (step / 1e3) if step > 0 else math.inf,
            inputs=inputs,
            timeline=timeline,
            **self._per_rank(stages),
        )

    def _per_rank(self, stages: Sequence[StagePrediction]) -> dict[str, tuple]:
        """With several stages per rank: each stage's rank, each rank's summed peak."""
        if self.layout.virtual == 1:
            return {}
        on = self.layout.stage_ranks
        total = [0.0] * self.layout.pp
        for st, r in zip(stages, on, strict=True):
            total[r] += st.memory.total
        return {"stage_ranks": on, "rank_memory": tuple(total)}

    def step_ms(self, starts: Sequence[int]) -> float:
        """``predict(starts).step_ms``, the same number, with each segment's figures
        computed once (what the step solver evaluates, thousands of times)."""
        bounds = self._bounds(starts)
        stages = []
        for s in range(self.layout.n_stages):
            key = (s, bounds[s], bounds[s + 1])
            if key not in self._stages:
                self._stages[key] = self._stage(*key)
            stages.append(self._stages[key])
        return replay(self._inputs(stages, bounds)).step_ms

    def _bounds(self, starts: Sequence[int]) -> list[int]:
        n = self.layout.n_stages
        bounds = [*starts, self.n_blocks]
        if len(starts) != n or starts[0] != 0:
            raise ValueError(f"starts must have {n} entries beginning with 0")
        for s in range(n):
            if not bounds[s] < bounds[s + 1]:
                raise ValueError(f"stage {s} is empty (starts {list(starts)})")
        return bounds

    def _stage(self, s: int, i: int, j: int) -> StagePrediction:
        rc = self.recompute(s, i, j)
        last = s == self.layout.n_stages - 1
        f, b = (0.0, 0.0) if last else self.time.cut(s, j)
        return StagePrediction(
            index=s,
            blocks=(i, j),
            device="+".join(self.basis.stage_types[s]),
            fwd_ms=self.time.fwd(s, i, j),
            bwd_ms=self.time.bwd(s, i, j, rc),
            recompute=rc,
            send_fwd_ms=f,
            send_bwd_ms=b,
            sync_ms=self.time.sync(s, i, j),
            memory=self.memory(s, i, j, rc),
            capacity=self.capacity[s],
        )

    def _inputs(self, stages: Sequence[StagePrediction], bounds: Sequence[int]) -> StepInputs:
        """What the simulation takes: each action's time alone, the speed of each moment,
        DDP's all-reduce inside the last backward; which stages exchange tied weights."""
        scale = self.time.compute_scale
        reduce = [self.time.reduce_ms(s, bounds[s], bounds[s + 1]) for s in range(len(stages))]
        return StepInputs(
            schedule=self.layout.schedule,
            micro_batches=self.layout.micro_batches,
            fwd_ms=tuple(x.fwd_ms / scale for x in stages),
            bwd_ms=tuple(x.bwd_ms / scale for x in stages),
            link_fwd_ms=tuple(x.send_fwd_ms for x in stages[:-1]),
            link_bwd_ms=tuple(x.send_bwd_ms for x in stages[:-1]),
            reduce_ms=tuple(reduce),
            tail_ms=tuple(x.sync_ms - r for x, r in zip(stages, reduce, strict=True)),
            speed=tuple(self.time.speeds),
            join=tuple(tuple(g) for g in self.time.joined(bounds)),
            virtual=self.layout.virtual,
        )
