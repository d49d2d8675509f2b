"""The cost model: the one place that turns a placement into predicted time and memory.

For a layout (``pp`` stages × ``dp`` replicas, ``m`` micro-batches of
``b = B / (dp·m)`` samples, a schedule) and a stage holding blocks ``[i, j)``:

* **compute** per micro-batch: Σ forward and Σ backward of its blocks at ``b``
  on the stage's device type (+ the loss on the last stage, + one more forward
  when the stage recomputes activations), plus a fixed cost per pipeline
  action (``ACTION_OVERHEAD_MS``: the schedule's bookkeeping and p2p handshake).
* **p2p**: the bytes live across the split point (``boundary_bytes``, skip
  connections included) sent forward, and their gradients sent back, over the
  link joining the two stages' devices: latency + bytes / bandwidth.
* **all-reduce** of the stage's gradients across its ``dp`` replicas (ring:
  2(n−1)/n · bytes / bandwidth), once per step after the last backward; plus
  the all-reduce of tied-parameter copies between the stages that hold them;
  then the **optimizer step**, a memory-bound pass over weights, gradients and
  optimizer state (read and written once) at the device's memory bandwidth.
* **memory** = parameters + gradients + optimizer state (bytes per parameter
  from ``--precision`` and ``--optimizer``, see ``state_bytes``) + buffers +
  DDP's gradient buckets (dp > 1) + tied copies (full state for each extra copy)
  + activations in flight: ``m`` micro-batches for GPipe, ``min(m, pp − s)`` on
  stage s for 1F1B; with recompute only each in-flight micro-batch's stage
  input is kept, plus one micro-batch's activations while it is recomputed.

Step time: the discrete-event simulation of the schedule (``simulate``); its
closed form is what the ILP minimises (exact for GPipe).

Pure: no torch. Times in milliseconds, sizes in bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate

from planner.cluster import Cluster
from planner.records import DTYPE_BYTES, ModelProfile
from planner.simulate import SCHEDULES, Timeline, closed_form, simulate
from planner.solve import PartitionProblem

__all__ = [
    "ACTION_OVERHEAD_MS",
    "OPTIMIZERS",
    "PRECISIONS",
    "CostModel",
    "Layout",
    "MemoryBreakdown",
    "Prediction",
    "StagePrediction",
    "Training",
    "state_bytes",
]

OPTIMIZERS = ("adam", "adamw", "sgd")
PRECISIONS = ("fp32", "bf16-mixed")

# Fixed cost of one pipeline action (a forward or a backward of one micro-batch
# on one stage), on top of the blocks' measured time: the schedule's Python
# bookkeeping and the p2p handshake. gloo: measured by bench/bench_runtime.py
# on a near-empty stage, 0.56–0.70 ms (median 0.68) per action on the 2-core
# machine. NCCL: kernel-launch scale, not measured here (no GPU lent).
ACTION_OVERHEAD_MS = {"gloo": 0.7, "nccl": 0.05}

# Local CPU "devices" share one machine's memory system: with every process
# computing at once, each stage's fwd+bwd ran 1.09–1.29× slower than alone
# (bench/bench_runtime.py, "corun"); the profile measures one process alone.
CPU_CORUN_SLOWDOWN = 1.15


def state_bytes(precision: str, optimizer: str) -> tuple[float, float, float]:
    """Bytes per parameter of (weights, gradients, optimizer state).

    fp32: 4 + 4 + (Adam: two fp32 moments = 8; SGD with momentum: 4).
    bf16-mixed: bf16 weights and gradients (2 + 2), plus fp32 master weights in
    the optimizer state (4 + Adam's 8 = 12; SGD's 4 + 4 = 8): 16 B/param with
    Adam, as in the ZeRO paper.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    moments = 8.0 if optimizer in ("adam", "adamw") else 4.0
    if precision == "fp32":
        return 4.0, 4.0, moments
    return 2.0, 2.0, 4.0 + moments


@dataclass(frozen=True, kw_only=True)
class Training:
    """What one step trains on, and with what.

    Attributes:
        global_batch: samples per optimizer step, over all replicas.
        optimizer: "adam", "adamw" or "sgd" (with momentum); sets the optimizer
            state per parameter.
        precision: "fp32" or "bf16-mixed" (bf16 weights and activations, fp32
            master weights).
        memory_headroom: share of each device's memory kept free for the
            allocator's fragmentation, workspaces and the runtime (0.1 = 10 %).
    """

    global_batch: int
    optimizer: str = "adam"
    precision: str = "fp32"
    memory_headroom: float = 0.1

    def __post_init__(self) -> None:
        if self.global_batch < 1:
            raise ValueError(f"global batch must be ≥ 1, got {self.global_batch}")
        state_bytes(self.precision, self.optimizer)  # validates both
        if not 0 <= self.memory_headroom < 1:
            raise ValueError(f"memory_headroom must be in [0, 1), got {self.memory_headroom}")


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Pipeline depth × data-parallel width × micro-batching, and the devices.

    Attributes:
        pp, dp, micro_batches, schedule: as named.
        ranks: ``ranks[s][r]`` is the cluster rank running stage s of replica r.
    """

    pp: int
    dp: int
    micro_batches: int
    schedule: str
    ranks: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}"
            )
        if len(self.ranks) != self.pp or any(len(r) != self.dp for r in self.ranks):
            raise ValueError(f"ranks must be {self.pp} stages × {self.dp} replicas")

    def micro_batch_size(self, global_batch: int) -> int:
        per = self.dp * self.micro_batches
        if global_batch % per:
            raise ValueError(
                f"global batch {global_batch} is not divisible by dp × micro-batches = "
                f"{self.dp} × {self.micro_batches} = {per}"
            )
        return global_batch // per

    def in_flight(self, stage: int) -> int:
        """Micro-batches whose activations stage ``stage`` holds at its peak."""
        if self.schedule == "1f1b":
            return min(self.micro_batches, self.pp - stage)
        return self.micro_batches


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Peak bytes on one device of a stage."""

    params: float
    grads: float
    optimizer: float
    buffers: float
    comm_buffers: float
    tied_copies: float
    activations: float

    @property
    def total(self) -> float:
        return (
            self.params
            + self.grads
            + self.optimizer
            + self.buffers
            + self.comm_buffers
            + self.tied_copies
            + self.activations
        )


@dataclass(frozen=True, kw_only=True)
class StagePrediction:
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
    """The predicted step of a placement."""

    stages: tuple[StagePrediction, ...]
    step_ms: float
    closed_form_ms: float
    bubble_fraction: float
    samples_per_s: float
    timeline: Timeline

    @property
    def fits(self) -> bool:
        return all(s.memory.total <= s.capacity for s in self.stages)


class _Table:
    """Prefix sums over one profile's blocks, for O(1) segment costs."""

    def __init__(self, prof: ModelProfile) -> None:
        b = prof.blocks
        self.n = len(b)
        self.fwd = [0.0, *accumulate(x.fwd_ms for x in b)]
        self.bwd = [0.0, *accumulate(x.bwd_ms for x in b)]
        self.params = [0.0, *accumulate(float(x.param_bytes) for x in b)]
        self.buffers = [0.0, *accumulate(float(x.buffer_bytes) for x in b)]
        self.act = [0.0, *accumulate(float(x.activation_bytes) for x in b)]
        self.boundary = [float(x.boundary_bytes) for x in b]
        self.output = [float(x.output_bytes) for x in b]
        self.loss_fwd = prof.loss_fwd_ms
        self.loss_bwd = prof.loss_bwd_ms
        self.input_bytes = float(prof.input_bytes)


class CostModel:
    """Costs of placements for one layout.

    Example::

        cm = CostModel({"cpu": prof}, cluster, Training(global_batch=32), layout)
        problem = cm.problem()                # for solve_partition
        pred = cm.predict(solution.starts)    # per-stage figures + timeline

    Args:
        profiles: per device type (catalogue key), the model's profile at this
            layout's micro-batch size.
        cluster, training, layout: as named.
    """

    def __init__(
        self,
        profiles: Mapping[str, ModelProfile],
        cluster: Cluster,
        training: Training,
        layout: Layout,
    ) -> None:
        self.cluster = cluster
        self.training = training
        self.layout = layout
        self.micro_batch_size = layout.micro_batch_size(training.global_batch)
        self.stage_types = [
            sorted({cluster.devices[r].device.key for r in layout.ranks[s]})
            for s in range(layout.pp)
        ]
        missing = {t for ts in self.stage_types for t in ts} - set(profiles)
        if missing:
            raise ValueError(f"no profile for device type(s) {sorted(missing)}")
        any_prof = next(iter(profiles.values()))
        for key, prof in profiles.items():
            if prof.batch_size != self.micro_batch_size:
                raise ValueError(
                    f"the {key} profile is for micro-batch {prof.batch_size}, "
                    f"the layout needs {self.micro_batch_size}"
                )
            if len(prof.blocks) != len(any_prof.blocks):
                raise ValueError("profiles of different device types have different blocks")
        self.profile = any_prof
        self.tables = {k: _Table(p) for k, p in profiles.items()}
        self.n_blocks = len(any_prof.blocks)
        self.weights_b, self.grads_b, self.optim_b = state_bytes(
            training.precision, training.optimizer
        )
        self.param_elem = DTYPE_BYTES.get(any_prof.dtype, 4)
        # Activations are profiled in the profile's dtype; bf16-mixed halves fp32 ones.
        self.act_scale = 0.5 if training.precision == "bf16-mixed" and self.param_elem == 4 else 1.0
        backend = cluster.backend
        self.overhead = ACTION_OVERHEAD_MS.get(backend, 0.0)
        shared_cpu = backend == "gloo" and layout.pp * layout.dp > 1
        self.compute_scale = CPU_CORUN_SLOWDOWN if shared_cpu else 1.0
        self.capacity = [
            min(cluster.devices[r].device.memory_bytes for r in layout.ranks[s])
            * (1 - training.memory_headroom)
            for s in range(layout.pp)
        ]

    # ----------------------------------------------------------------- compute

    def _fwd(self, s: int, i: int, j: int) -> float:
        out = 0.0
        for t in self.stage_types[s]:
            tab = self.tables[t]
            v = tab.fwd[j] - tab.fwd[i] + (tab.loss_fwd if j == self.n_blocks else 0.0)
            out = max(out, v)
        return out * self.compute_scale + self.overhead

    def _bwd(self, s: int, i: int, j: int, recompute: bool) -> float:
        out = 0.0
        for t in self.stage_types[s]:
            tab = self.tables[t]
            v = tab.bwd[j] - tab.bwd[i] + (tab.loss_bwd if j == self.n_blocks else 0.0)
            if recompute:
                v += tab.fwd[j] - tab.fwd[i]
            out = max(out, v)
        return out * self.compute_scale + self.overhead

    # ----------------------------------------------------------------- memory

    @cached_property
    def _tied(self) -> list[tuple[int, float, tuple[int, ...]]]:
        """(owner block, bytes, user blocks) of each tied set."""
        return [(min(t.blocks), float(t.nbytes), t.blocks) for t in self.profile.tied if t.blocks]

    def _tied_copy_bytes(self, i: int, j: int) -> float:
        """Bytes of tied tensors this stage uses but whose owner block is elsewhere."""
        return sum(
            nbytes
            for owner, nbytes, users in self._tied
            if not i <= owner < j and any(i <= u < j for u in users)
        )

    def memory(self, s: int, i: int, j: int, recompute: bool = False) -> MemoryBreakdown:
        tab = self.tables[self.stage_types[s][0]]
        n_params = (tab.params[j] - tab.params[i]) / self.param_elem
        tied_params = self._tied_copy_bytes(i, j) / self.param_elem
        per_param = self.weights_b + self.grads_b + self.optim_b
        scale = self.act_scale
        stage_input = tab.boundary[i] if i > 0 else tab.input_bytes
        stage_output = tab.output[j - 1]
        acts = (tab.act[j] - tab.act[i]) * scale
        held = (stage_input + stage_output) * scale
        n = self.layout.in_flight(s)
        activations = n * held + (acts if recompute else n * acts)
        return MemoryBreakdown(
            params=n_params * self.weights_b,
            grads=n_params * self.grads_b,
            optimizer=n_params * self.optim_b,
            buffers=tab.buffers[j] - tab.buffers[i],
            comm_buffers=n_params * self.grads_b if self.layout.dp > 1 else 0.0,
            tied_copies=tied_params * per_param,
            activations=activations,
        )

    def _recompute(self, s: int, i: int, j: int) -> bool:
        """Recompute only when the stage does not fit without it (and does with it)."""
        if self.memory(s, i, j).total <= self.capacity[s]:
            return False
        return self.memory(s, i, j, True).total <= self.capacity[s]

    # ----------------------------------------------------------------- communication

    def cut(self, s: int, j: int) -> tuple[float, float]:
        """(forward, backward) transfer time per micro-batch on link s → s+1 at block j."""
        tab = self.tables[self.stage_types[s][0]]
        nbytes = tab.boundary[j] * self.act_scale
        worst = 0.0
        for r in range(self.layout.dp):
            a, b = self.layout.ranks[s][r], self.layout.ranks[s + 1][r]
            worst = max(worst, self.cluster.p2p_time(a, b, nbytes))
        return worst * 1e3, worst * 1e3

    def optimizer_ms(self, s: int, i: int, j: int) -> float:
        """The optimizer step of stage s: weights and state read and written, gradients read."""
        tab = self.tables[self.stage_types[s][0]]
        n_params = (tab.params[j] - tab.params[i]) / self.param_elem
        moved = n_params * (2 * (self.weights_b + self.optim_b) + self.grads_b)
        slowest = 0.0
        for r in self.layout.ranks[s]:
            dev = self.cluster.devices[r].device
            slowest = max(slowest, moved / (dev.memory_bandwidth * dev.memory_efficiency))
        return slowest * 1e3

    def sync(self, s: int, i: int, j: int) -> float:
        """The step's tail on stage s (ms): gradient all-reduce (tied copies
        included), then the optimizer step.

        [Note: tied copies] A stage using a tied tensor whose owner block sits
        on another stage holds a copy; the copy's gradient is all-reduced with
        the owner's every step. Which stage owns it is not known per segment,
        so the exchange is priced on the slowest link from this stage to any
        other stage of the replica.
        """
        tab = self.tables[self.stage_types[s][0]]
        n_params = (tab.params[j] - tab.params[i]) / self.param_elem
        t = 0.0
        if self.layout.dp > 1:
            t = self.cluster.allreduce_time(self.layout.ranks[s], n_params * self.grads_b)
        tied = self._tied_copy_bytes(i, j) / self.param_elem * self.grads_b
        if tied:
            me = self.layout.ranks[s][0]
            t += max(
                (
                    self.cluster.allreduce_time((self.layout.ranks[o][0], me), tied)
                    for o in range(self.layout.pp)
                    if o != s
                ),
                default=0.0,
            )
        return t * 1e3 + self.optimizer_ms(s, i, j)

    # ----------------------------------------------------------------- the ILP

    def problem(
        self, allowed_starts: frozenset[int] | None = None, names: Sequence[str] = ()
    ) -> PartitionProblem:
        """The ``PartitionProblem`` for this layout (the closed-form objective).

        A stage that does not fit without recompute is costed with it, when
        that fits: the cheaper choice that fits is always the right one for a
        single stage, so the ILP never needs a recompute variable.
        """

        def work(s: int, i: int, j: int) -> float:
            rc = self._recompute(s, i, j)
            return self._fwd(s, i, j) + self._bwd(s, i, j, rc)

        def mem(s: int, i: int, j: int) -> float:
            m0 = self.memory(s, i, j).total
            if m0 <= self.capacity[s]:
                return m0
            m1 = self.memory(s, i, j, True).total
            return m1 if m1 <= self.capacity[s] else m0

        def cut(s: int, j: int) -> float:
            f, b = self.cut(s, j)
            return f + b

        # Stages with the same device types, nodes and replica layout cost the same.
        labels: dict[tuple, int] = {}
        stage_class = [
            labels.setdefault((tuple(self.stage_types[s]), self._rank_signature(s)), len(labels))
            for s in range(self.layout.pp)
        ]
        return PartitionProblem(
            n_blocks=self.n_blocks,
            n_stages=self.layout.pp,
            micro_batches=self.layout.micro_batches,
            seg_work=work,
            seg_memory=mem,
            capacity=self.capacity,
            cut_time=cut,
            seg_sync=self.sync,
            allowed_starts=allowed_starts,
            stage_class=stage_class,
            block_names=list(names) or None,
        )

    def _rank_signature(self, s: int) -> tuple[int, ...]:
        return tuple(self.cluster.devices[r].node for r in self.layout.ranks[s])

    # ----------------------------------------------------------------- prediction

    def predict(self, starts: Sequence[int]) -> Prediction:
        """Per-stage figures and the simulated step of the placement ``starts``."""
        bounds = [*starts, self.n_blocks]
        if len(starts) != self.layout.pp or starts[0] != 0:
            raise ValueError(f"starts must have {self.layout.pp} entries beginning with 0")
        stages = []
        for s in range(self.layout.pp):
            i, j = bounds[s], bounds[s + 1]
            if not i < j:
                raise ValueError(f"stage {s} is empty (starts {list(starts)})")
            rc = self._recompute(s, i, j)
            f, b = self.cut(s, j) if s < self.layout.pp - 1 else (0.0, 0.0)
            stages.append(
                StagePrediction(
                    index=s,
                    blocks=(i, j),
                    device="+".join(self.stage_types[s]),
                    fwd_ms=self._fwd(s, i, j),
                    bwd_ms=self._bwd(s, i, j, rc),
                    recompute=rc,
                    send_fwd_ms=f,
                    send_bwd_ms=b,
                    sync_ms=self.sync(s, i, j),
                    memory=self.memory(s, i, j, rc),
                    capacity=self.capacity[s],
                )
            )
        kw = dict(
            fwd=[x.fwd_ms for x in stages],
            bwd=[x.bwd_ms for x in stages],
            micro_batches=self.layout.micro_batches,
            schedule=self.layout.schedule,
            link_fwd=[x.send_fwd_ms for x in stages[:-1]],
            link_bwd=[x.send_bwd_ms for x in stages[:-1]],
            sync=[x.sync_ms for x in stages],
        )
        timeline = simulate(**kw)  # type: ignore[arg-type]
        closed = closed_form(**kw)  # type: ignore[arg-type]
        step = timeline.step_ms
        return Prediction(
            stages=tuple(stages),
            step_ms=step,
            closed_form_ms=closed,
            bubble_fraction=timeline.bubble_fraction,
            samples_per_s=self.training.global_batch / (step / 1e3) if step > 0 else math.inf,
            timeline=timeline,
        )
