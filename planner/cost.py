"""The cost model: the one place that turns a placement into predicted time and memory.

For a layout (``pp`` stages × ``dp`` replicas, ``m`` micro-batches of
``b = B / (dp·m)`` samples, a schedule) and a stage holding blocks ``[i, j)``:

* **compute** per micro-batch: Σ forward and Σ backward of its blocks at ``b``
  on the stage's device type (+ the loss on the last stage, + one more forward
  when the stage recomputes activations), plus a fixed cost per pipeline
  action (``ACTION_OVERHEAD_MS``: the schedule's bookkeeping and p2p handshake).
  Local CPU processes share the machine's cores ([Note: shared cores] in
  ``planner.simulate``, ``cpu_speeds``): the simulation slows the stages that
  compute at once; the per-action figures reported are the steady state's.
* **p2p**: the bytes live across the split point (``boundary_bytes``, skip
  connections included) sent forward, and their gradients sent back, over the
  link joining the two stages' devices: latency + bytes / bandwidth (between
  CPU processes slowed like compute, and with a wake-up wait when the cores are
  oversubscribed: ``CPU_OVERSUBSCRIBED_WAKEUP_S``).
* **all-reduce** of the stage's gradients across its ``dp`` replicas (ring:
  2(n−1)/n · bytes / bandwidth), inside the stage's last backward (DDP), so it
  delays the gradient sent to the stage before; then the all-reduce of tied
  weights among the stages holding them, which start it together ([Note: tied
  copies]); then the **optimizer step**: on GPUs a memory-bound pass over
  weights, gradients and optimizer state at the device's memory bandwidth, on
  CPUs per tensor ([Note: the CPU optimizer step]).
* **memory**: the peak bytes of live tensors over a step, and what they are at
  that moment; see [Note: the memory peak] at ``CostModel.memory``.

Step time: the discrete-event simulation of the schedule (``simulate``); its
closed form is what the ILP minimises (exact for GPipe on GPUs).

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
# Applied while more than one process computes (see cpu_speeds).
CPU_CORUN_SLOWDOWN = 1.15


# When local CPU processes outnumber the cores (pp × dp × threads > cores), a
# process woken by a message often waits for a core first: about a scheduler time
# slice. Fitted on the 2-core machine, pp 2 × dp 2 (4 processes): 2 ms per message
# (before the time-slicing factor, so ~4.6 ms in all) took the step errors of the
# four examples from −14…−21 % to −7…+2 % (bench/bench_accuracy.py).
CPU_OVERSUBSCRIBED_WAKEUP_S = 2e-3


def cpu_speeds(*, stages: int, processes: int, threads: int, cores: int) -> list[float]:
    """[Note: shared cores] for local CPU processes: the speed of each computing
    process while k of the ``stages`` compute at once (k = 1 … stages).

    The ``processes`` of a node (each with ``threads`` torch threads) are spread
    over the stages, so k computing stages keep k/stages of them busy. More
    threads than ``cores`` are time-sliced (speed cores / threads busy), and two
    or more processes running at once share the memory bandwidth
    (``CPU_CORUN_SLOWDOWN``).

    Example::

        cpu_speeds(stages=2, processes=4, threads=1, cores=2)  # pp 2 × dp 2: [0.87, 0.43]
    """
    out = []
    for k in range(1, stages + 1):
        busy = max(1.0, k * processes / stages)  # processes computing
        share = min(1.0, cores / (busy * threads))
        running = min(busy, cores / threads)  # processes on a core at any instant
        out.append(share / (CPU_CORUN_SLOWDOWN if running > 1 else 1.0))
    return out


# [Note: the CPU optimizer step] On CPU torch steps one parameter tensor at a
# time (the foreach path is the default on GPUs only): per tensor a run of small
# ops, each costing a dispatch (the device's measured ``op_overhead_s``), and per
# parameter the traffic of those ops: Adam reads and writes 18 fp32 values (the
# moments' updates, sqrt, division, the addcdiv into the weights: 72 B), AdamW one
# more pass for the decay, SGD with momentum 8 (32 B), at the measured memory
# bandwidth, split over the process's threads (the ops are elementwise and the
# tensors, a few MB each, mostly stay in cache). Measured on the 2-core machine:
# Adam 22 µs per tensor (19 op overheads) and 1.8–5.7 ns per parameter with 1
# thread (72 B at its 21-23 GB/s: 3.1-3.4), 1.5–2.6 with 2; SGD 6.6 µs per
# tensor, 0.3–0.7 ns per parameter. Tensors per block: two per module call
# (weight and bias), the profile does not count them.
_CPU_STEP = {"adam": (19, 72.0), "adamw": (21, 80.0), "sgd": (6, 32.0)}

# [Note: optimizer temporaries] torch's Adam/AdamW step computes
# sqrt(exp_avg_sq) / bias_correction into new tensors. On CPU one parameter at a
# time (the single-tensor path: two of the parameter's size at once; the
# largest block's parameters, or a tied tensor, stand for the largest tensor);
# measured. On GPUs the default foreach path does it for all parameters at once
# (4 bytes per parameter at the step): not counted, no GPU was lent to measure
# it. SGD with momentum updates in place.


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
    """Bytes on one device of a stage at its peak, by kind; ``total`` is the peak.

    ``grads`` are the gradients live at that moment (none yet at the start of
    the step's first backward, all of them at the optimizer step);
    ``activations`` is everything else the step allocates: saved activations
    of the micro-batches in flight, the pipeline's receive buffers, the loss's
    tensors and the transient ones (an activation gradient, the optimizer's
    temporaries). ``tied_copies``: weights, gradients and optimizer state of
    tied copies (counted whole all step).
    """

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


class _RangeMax:
    """max(xs[i:j]) in O(1) after O(n log n) preparation (a sparse table); ties: first index."""

    def __init__(self, xs: Sequence[float]) -> None:
        level = [(x, -k) for k, x in enumerate(xs)]
        self.levels = [level]
        width = 1
        while 2 * width <= len(level):
            prev = self.levels[-1]
            self.levels.append([max(prev[a], prev[a + width]) for a in range(len(prev) - width)])
            width *= 2

    def __call__(self, i: int, j: int) -> tuple[float, int]:
        """(max of xs[i:j], its index), i < j."""
        k = (j - i).bit_length() - 1
        level = self.levels[k]
        value, neg = max(level[i], level[j - (1 << k)])
        return value, -neg


class _Table:
    """Prefix sums and range maxima over one profile's blocks, for O(1) segment costs."""

    def __init__(self, prof: ModelProfile, grad_per_param_byte: float, act_scale: float) -> None:
        b = prof.blocks
        self.n = len(b)
        self.fwd = [0.0, *accumulate(x.fwd_ms for x in b)]
        self.bwd = [0.0, *accumulate(x.bwd_ms for x in b)]
        self.params = [0.0, *accumulate(float(x.param_bytes) for x in b)]
        self.buffers = [0.0, *accumulate(float(x.buffer_bytes) for x in b)]
        self.act = [0.0, *accumulate(float(x.activation_bytes) * act_scale for x in b)]
        self.boundary = [float(x.boundary_bytes) for x in b]
        self.output = [float(x.output_bytes) for x in b]
        self.loss_fwd = prof.loss_fwd_ms
        self.loss_bwd = prof.loss_bwd_ms
        self.input_bytes = float(prof.input_bytes)
        # [Note: the memory peak], the first backward: after block k's backward the
        # gradients of blocks k.. exist and the activations of blocks ..k still do.
        grads = [p * grad_per_param_byte for p in self.params]
        self.backward_curve = _RangeMax([self.act[k + 1] - grads[k] for k in range(self.n)])
        self.grads = grads
        # A block's backward holds its output's gradient and its input's: the sums of
        # neighbouring outputs (the first block of a stage uses the stage's input).
        pairs = [self.output[k] + (self.output[k - 1] if k else 0.0) for k in range(self.n)]
        self.grad_pair = _RangeMax([x * act_scale for x in pairs])
        self.max_params = _RangeMax([float(x.param_bytes) for x in b])
        # [Note: the CPU optimizer step]: parameter tensors, two per module call.
        self.tensors = [0, *accumulate(2 * len(x.modules) if x.param_bytes else 0 for x in b)]


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
        self.n_blocks = len(any_prof.blocks)
        self.weights_b, self.grads_b, self.optim_b = state_bytes(
            training.precision, training.optimizer
        )
        self.param_elem = DTYPE_BYTES.get(any_prof.dtype, 4)
        # Activations are profiled in the profile's dtype; bf16-mixed halves fp32 ones.
        self.act_scale = 0.5 if training.precision == "bf16-mixed" and self.param_elem == 4 else 1.0
        self.tables = {
            k: _Table(p, self.grads_b / self.param_elem, self.act_scale)
            for k, p in profiles.items()
        }
        backend = cluster.backend
        self.overhead = ACTION_OVERHEAD_MS.get(backend, 0.0)
        self.speeds = self._speeds()
        # The ILP's closed form prices every action at the steady state's speed
        # (all stages computing); the simulation follows the speed moment by moment.
        self.compute_scale = 1.0 / self.speeds[-1]
        # Between local CPU processes a transfer is CPU work too (loopback copies):
        # it shares the cores as compute does.
        self.comm_scale = self.compute_scale if backend == "gloo" else 1.0
        self.wakeup_s = CPU_OVERSUBSCRIBED_WAKEUP_S if self._oversubscribed() else 0.0
        self.capacity = [
            min(cluster.devices[r].device.memory_bytes for r in layout.ranks[s])
            * (1 - training.memory_headroom)
            for s in range(layout.pp)
        ]

    # ----------------------------------------------------------------- compute

    def _speeds(self) -> list[float]:
        """Speed of a stage while k stages compute at once ([Note: shared cores])."""
        pp = self.layout.pp
        if self.cluster.backend != "gloo":
            return [1.0] * pp
        busiest = max(self.cluster.devices_per_node())
        ranks = [r for stage in self.layout.ranks for r in stage]
        threads = max(self.cluster.devices[r].threads for r in ranks) or 1
        return cpu_speeds(
            stages=pp,
            processes=min(busiest, len(ranks)),
            threads=threads,
            cores=self.cluster.cores_per_node,
        )

    def _oversubscribed(self) -> bool:
        """More busy threads than cores on a node, with every stage computing."""
        if self.cluster.backend != "gloo":
            return False
        ranks = [r for stage in self.layout.ranks for r in stage]
        threads = max(self.cluster.devices[r].threads for r in ranks) or 1
        busiest = min(max(self.cluster.devices_per_node()), len(ranks))
        return busiest * threads > self.cluster.cores_per_node

    def _fwd(self, s: int, i: int, j: int) -> float:
        out = 0.0
        for t in self.stage_types[s]:
            tab = self.tables[t]
            v = tab.fwd[j] - tab.fwd[i] + (tab.loss_fwd if j == self.n_blocks else 0.0)
            out = max(out, v)
        return (out + self.overhead) * self.compute_scale

    def _bwd(self, s: int, i: int, j: int, recompute: bool) -> float:
        out = 0.0
        for t in self.stage_types[s]:
            tab = self.tables[t]
            v = tab.bwd[j] - tab.bwd[i] + (tab.loss_bwd if j == self.n_blocks else 0.0)
            if recompute:
                v += tab.fwd[j] - tab.fwd[i]
            out = max(out, v)
        return (out + self.overhead) * self.compute_scale

    # ----------------------------------------------------------------- memory

    @cached_property
    def _tied(self) -> list[tuple[int, float, tuple[int, ...]]]:
        """(owner block, bytes, user blocks) of each tied set."""
        return [(min(t.blocks), float(t.nbytes), t.blocks) for t in self.profile.tied if t.blocks]

    def _tied_in(self, i: int, j: int) -> list[float]:
        """Bytes of each tied tensor that blocks [i, j) use."""
        return [nbytes for _, nbytes, users in self._tied if any(i <= u < j for u in users)]

    def _tied_copy_bytes(self, i: int, j: int) -> float:
        """Bytes of tied tensors this stage uses but whose owner block is elsewhere."""
        return sum(
            nbytes
            for owner, nbytes, users in self._tied
            if not i <= owner < j and any(i <= u < j for u in users)
        )

    def memory(self, s: int, i: int, j: int, recompute: bool = False) -> MemoryBreakdown:
        """The peak of live tensor bytes on a device of stage s holding blocks [i, j).

        [Note: the memory peak] Weights, optimizer state, buffers, DDP's buckets
        and the pipeline's receive buffers live all step; gradients and
        activations come and go, so the peak is the largest of these moments:

        * **the first backward** (GPipe, and 1F1B while m ≤ its in-flight count):
          the step began with no gradients (``zero_grad(set_to_none=True)``);
          the n micro-batches in flight hold their activations, and as one is
          run backward its blocks' gradients appear while its blocks' saved
          tensors go, so the peak is ``max over k`` of (gradients of blocks
          ≥ k + activations of blocks ≤ k) + n − 1 other micro-batches; on the
          last stage the loss's backward starts it, with the model's output,
          what the loss saved and two output-sized gradients live;
        * **a later backward with every gradient allocated** (1F1B with
          m > n: n micro-batches in flight again);
        * **the optimizer step**: all gradients, and the optimizer's temporaries
          ([Note: optimizer temporaries]).

        Per micro-batch in flight: the blocks' saved activations (each tensor
        once, charged to the block that made it), and on the last stage the
        model's output and what the loss saves (cross-entropy keeps its
        log-softmax, MSE its difference: about the output's size). Receive
        buffers: torch's pipelining keeps one input buffer per micro-batch on
        every stage after the first, and one output-gradient buffer per
        micro-batch on every stage before the last (the first stage holds the
        replica's batch instead). The backward moments add the gradients of a
        block's output and input (the stage's largest such pair) and, after the
        first stage, the previous micro-batch's input gradient still being
        sent. With recompute, the
        micro-batches in flight keep only their inputs, and the one run
        backward is recomputed first.
        """
        tab = self.tables[self.stage_types[s][0]]
        last = j == self.n_blocks
        n_params = (tab.params[j] - tab.params[i]) / self.param_elem
        tied_params = self._tied_copy_bytes(i, j) / self.param_elem
        scale = self.act_scale
        m, n = self.layout.micro_batches, self.layout.in_flight(s)
        stage_input = tab.boundary[i] if i > 0 else tab.input_bytes
        stage_output = tab.output[j - 1] if last else tab.boundary[j]
        recv = m * (stage_input + (0.0 if last else stage_output)) * scale
        acts = tab.act[j] - tab.act[i]
        loss = 2 * stage_output * scale if last else 0.0  # the output, and what the loss saves
        per_mb = (0.0 if recompute else acts) + loss
        others = (n - 1) * per_mb
        all_grads = n_params * self.grads_b  # tied copies' gradients: in tied_copies
        # In a block's backward: the gradients of its output and of its input; and the
        # stage input's gradient of the previous micro-batch, held until its send ends.
        first_pair = (tab.output[i] + stage_input) * scale
        pair = max(first_pair, tab.grad_pair(i + 1, j)[0]) if j > i + 1 else first_pair
        grad_tmp = pair + (stage_input * scale if i > 0 else 0.0)
        # The first backward: gradients of blocks >= k, activations of blocks <= k.
        _, k = tab.backward_curve(i, j)
        first_grads = tab.grads[j] - tab.grads[k]
        first_acts = tab.act[k + 1] - tab.act[i]
        moments = [(first_grads, recv + others + first_acts + loss + grad_tmp)]
        if last:  # the loss's backward opens it: no gradients yet, two output-sized ones
            moments.append((0.0, recv + others + acts + loss + 2 * stage_output * scale))
        if m > n:  # 1F1B's steady state: every gradient exists, n micro-batches in flight
            moments.append((all_grads, recv + n * per_mb + (acts if recompute else 0) + grad_tmp))
        moments.append((all_grads, recv + self._optimizer_temp(s, i, j, n_params)))
        grads, activations = max(moments, key=lambda g_a: g_a[0] + g_a[1])
        return MemoryBreakdown(
            params=n_params * self.weights_b,
            grads=grads,
            optimizer=n_params * self.optim_b,
            buffers=tab.buffers[j] - tab.buffers[i],
            comm_buffers=(n_params + tied_params) * self.grads_b if self.layout.dp > 1 else 0.0,
            tied_copies=tied_params * (self.weights_b + self.grads_b + self.optim_b),
            activations=activations,
        )

    def _optimizer_temp(self, s: int, i: int, j: int, n_params: float) -> float:
        """Temporaries of the optimizer step (bytes): [Note: optimizer temporaries]."""
        if self.training.optimizer == "sgd":
            return 0.0
        if self.cluster.backend != "gloo":
            return 0.0  # GPUs: not measured here (see the note)
        tab = self.tables[self.stage_types[s][0]]
        largest = max([tab.max_params(i, j)[0], *self._tied_in(i, j)])
        return 2 * largest / self.param_elem * 4  # per tensor: two of the largest, fp32

    def _recompute(self, s: int, i: int, j: int) -> bool:
        """Recompute exactly when the stage does not fit without it.

        Also when it does not fit with it either: that segment is infeasible anyway,
        and costing it with recompute keeps a segment's work at least its parts'
        (the partition heuristic's bisection relies on that), and its memory the
        smaller figure the user would have to fit.
        """
        return self.memory(s, i, j).total > self.capacity[s]

    # ----------------------------------------------------------------- communication

    def cut(self, s: int, j: int) -> tuple[float, float]:
        """(forward, backward) transfer time per micro-batch on link s → s+1 at block j."""
        tab = self.tables[self.stage_types[s][0]]
        nbytes = tab.boundary[j] * self.act_scale
        worst = 0.0
        for r in range(self.layout.dp):
            a, b = self.layout.ranks[s][r], self.layout.ranks[s + 1][r]
            worst = max(worst, self.cluster.p2p_time(a, b, nbytes) + self.wakeup_s)
        return worst * 1e3 * self.comm_scale, worst * 1e3 * self.comm_scale

    def optimizer_ms(self, s: int, i: int, j: int) -> float:
        """The optimizer step of stage s (tied copies included).

        GPUs: a memory-bound pass, weights and state read and written and the
        gradients read once, at the device's memory bandwidth. Local CPUs: see
        [Note: the CPU optimizer step].
        """
        tab = self.tables[self.stage_types[s][0]]
        copies = self._tied_copy_bytes(i, j) / self.param_elem
        n_params = (tab.params[j] - tab.params[i]) / self.param_elem + copies
        cpu = self.cluster.backend == "gloo"
        if cpu:
            ops, per_param = _CPU_STEP[self.training.optimizer]
            moved = n_params * per_param
            tensors = tab.tensors[j] - tab.tensors[i] + (1 if copies else 0)
        else:
            moved = n_params * (2 * (self.weights_b + self.optim_b) + self.grads_b)
        slowest = 0.0
        for r in self.layout.ranks[s]:
            dev = self.cluster.devices[r].device
            t = moved / (dev.memory_bandwidth * dev.memory_efficiency)
            if cpu:  # every process steps at the end: the steady state's speed
                threads = max(1, self.cluster.devices[r].threads)
                t = (t / threads + tensors * ops * dev.op_overhead_s) * self.compute_scale
            slowest = max(slowest, t)
        return slowest * 1e3

    def reduce_ms(self, s: int, i: int, j: int) -> float:
        """DDP's all-reduce of stage s's gradients across its replicas (tied copies
        included), in ms; it runs inside the stage's last backward."""
        if self.layout.dp == 1:
            return 0.0
        tab = self.tables[self.stage_types[s][0]]
        n_params = (tab.params[j] - tab.params[i] + self._tied_copy_bytes(i, j)) / self.param_elem
        t = self.cluster.allreduce_time(self.layout.ranks[s], n_params * self.grads_b)
        t += 2 * (self.layout.dp - 1) * self.wakeup_s  # a ring's 2(n − 1) messages
        return t * 1e3 * self.comm_scale

    def tied_ms(self, s: int, i: int, j: int) -> float:
        """The all-reduce of tied weights' gradients that stage s shares with other
        stages, in ms.

        [Note: tied copies] A stage using a tied tensor whose owner block sits
        on another stage holds a copy; the copy's gradient is all-reduced with
        the owner's every step, by every stage holding one (the owner too), and
        none of them goes on before all have joined. Which other stages hold it
        is not known per segment, so the exchange is priced on the slowest link
        from this stage to any other stage of the replica.
        """
        nbytes = sum(
            n
            for owner, n, users in self._tied
            if any(i <= u < j for u in users) and not all(i <= u < j for u in users)
        )
        if not nbytes:
            return 0.0
        grads = nbytes / self.param_elem * self.grads_b
        me = self.layout.ranks[s][0]
        return (
            self.comm_scale
            * 1e3
            * max(
                (
                    self.cluster.allreduce_time((self.layout.ranks[o][0], me), grads)
                    + 2 * self.wakeup_s
                    for o in range(self.layout.pp)
                    if o != s
                ),
                default=0.0,
            )
        )

    def sync(self, s: int, i: int, j: int) -> float:
        """The step's tail on stage s (ms): DDP's gradient all-reduce, the tied
        weights' exchange ([Note: tied copies]), then the optimizer step."""
        return self.reduce_ms(s, i, j) + self.tied_ms(s, i, j) + self.optimizer_ms(s, i, j)

    def _joined(self, bounds: Sequence[int]) -> list[list[int]]:
        """Groups of stages that all-reduce tied weights together (a collective)."""
        groups: list[set[int]] = []
        for _, _, users in self._tied:
            stages = {
                s for s in range(self.layout.pp) for u in users if bounds[s] <= u < bounds[s + 1]
            }
            if len(stages) < 2:
                continue
            for g in [g for g in groups if g & stages]:
                groups.remove(g)
                stages |= g
            groups.append(stages)
        return [sorted(g) for g in groups]

    # ----------------------------------------------------------------- the ILP

    def problem(
        self, allowed_starts: frozenset[int] | None = None, names: Sequence[str] = ()
    ) -> PartitionProblem:
        """The ``PartitionProblem`` for this layout (the closed-form objective).

        A stage that does not fit without recompute is costed with it: the
        cheaper choice that fits is always the right one for a single stage, so
        the ILP never needs a recompute variable.
        """

        def work(s: int, i: int, j: int) -> float:
            rc = self._recompute(s, i, j)
            return self._fwd(s, i, j) + self._bwd(s, i, j, rc)

        def mem(s: int, i: int, j: int) -> float:
            return self.memory(s, i, j, self._recompute(s, i, j)).total

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
        closed = closed_form(**kw)  # type: ignore[arg-type]
        # The simulation takes each action's time alone and the speed of each moment;
        # DDP's all-reduce inside the last backward; tied stages join for their tail.
        reduce = [self.reduce_ms(s, bounds[s], bounds[s + 1]) for s in range(self.layout.pp)]
        kw["fwd"] = [x.fwd_ms / self.compute_scale for x in stages]
        kw["bwd"] = [x.bwd_ms / self.compute_scale for x in stages]
        kw["sync"] = [x.sync_ms - r for x, r in zip(stages, reduce, strict=True)]
        timeline = simulate(
            **kw,  # type: ignore[arg-type]
            speed=self.speeds,
            reduce=reduce,
            join=self._joined(bounds),
        )
        step = timeline.step_ms
        return Prediction(
            stages=tuple(stages),
            step_ms=step,
            closed_form_ms=closed,
            bubble_fraction=timeline.bubble_fraction,
            samples_per_s=self.training.global_batch / (step / 1e3) if step > 0 else math.inf,
            timeline=timeline,
        )
