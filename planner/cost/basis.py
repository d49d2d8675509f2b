"""What every stage figure of one layout is priced from: the layout, and tables of the blocks.

:class:`Layout` is a configuration (pp × dp × m, the schedule, which rank runs
which stage); :class:`CostBasis` joins it with the profiles, the cluster and
the training: prefix sums over the blocks (so any run of blocks costs O(1)),
the bytes per parameter, the tied sets, and each stage's device types and
usable memory. ``stage_time`` and ``stage_memory`` price from it.

Pure: no torch. Times in milliseconds, sizes in bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate

from planner.devices.cluster import Cluster
from planner.options import DP_MODES, OPTIMIZERS, PRECISIONS, Training
from planner.plan.records import DTYPE_BYTES, ModelProfile
from planner.plan.schedule import SIMULATED, in_flight, schedule_problem, stage_ranks
from planner.plan.shares import share_loads

__all__ = ["BlockTable", "CostBasis", "Layout", "RangeMax", "state_bytes", "wire_bytes"]


def state_bytes(precision: str, optimizer: str) -> tuple[float, float, float]:
    """Bytes per parameter of (weights, gradients, optimizer state) that live all step.

    fp32: 4 + 4 + (Adam: two fp32 moments = 8; SGD with momentum: 4).
    bf16-mixed, as the runtime runs it (autocast: [Note: bf16-mixed as it runs]
    in ``runtime.precision``): the same fp32 weights (the master copy), fp32
    gradients and fp32 moments; its bf16 copy of each weight (2 B, alive from
    the step's first forward to its last backward) is :attr:`CostBasis.cast_b`,
    and DDP reduces the gradients in bf16 (:attr:`CostBasis.wire_b`).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    moments = 8.0 if optimizer in ("adam", "adamw") else 4.0
    return 4.0, 4.0, moments


def wire_bytes(profile: ModelProfile, training: Training) -> float:
    """Bytes DDP's gradient all-reduces move for the whole model (tied copies left out):
    Σ parameters × :attr:`CostBasis.wire_b`, as the stages' ``reduce_ms`` price them."""
    _, grads_b, _ = state_bytes(training.precision, training.optimizer)
    wire_b = 2.0 if training.precision == "bf16-mixed" else grads_b
    elem = DTYPE_BYTES.get(profile.dtype, 4)
    return sum(float(b.param_bytes) for b in profile.blocks) / elem * wire_b


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Pipeline depth × data-parallel width × micro-batching, and the devices.

    Attributes:
        pp, dp, micro_batches, schedule: as named.
        ranks: ``ranks[s][r]`` is the cluster rank running stage s of replica r
            (the stages of one pipeline rank: the same ranks).
        virtual: stages per pipeline rank; the layout has ``pp · virtual`` stages.
        dp_mode: how the replicas hold the optimizer state (``DP_MODES``): "ddp",
            each all of it; "zero1", each a share ([Note: ZeRO-1 shares]); "fsdp",
            each a shard of every parameter ([Note: FSDP as it runs]).
    """

    pp: int
    dp: int
    micro_batches: int
    schedule: str
    ranks: tuple[tuple[int, ...], ...]
    virtual: int = 1
    dp_mode: str = "ddp"

    def __post_init__(self) -> None:
        if self.dp_mode not in DP_MODES:
            modes = ", ".join(DP_MODES)
            raise ValueError(f"unknown dp mode {self.dp_mode!r}; choose one of {modes}")
        if self.dp_mode != "ddp" and self.dp == 1:
            raise ValueError(
                f"dp mode {self.dp_mode} shares optimizer state among replicas: it needs dp ≥ 2 "
                "(got dp 1); use dp_mode ddp, or a dp ≥ 2"
            )
        if self.schedule not in SIMULATED:
            raise ValueError(
                f"unknown schedule {self.schedule!r}; choose one of {', '.join(SIMULATED)}"
            )
        problem = schedule_problem(self.schedule, self.pp, self.micro_batches, self.virtual)
        if problem is not None and self.virtual > 1:
            raise ValueError(f"{problem[0]}; fix: {problem[1]}")
        n = self.n_stages
        if len(self.ranks) != n or any(len(r) != self.dp for r in self.ranks):
            raise ValueError(f"ranks must be {n} stages × {self.dp} replicas")
        on = self.stage_ranks if self.virtual > 1 else ()
        for s in range(len(on)):
            first = on.index(on[s])
            if self.ranks[s] != self.ranks[first]:
                raise ValueError(
                    f"stage {s} runs on pipeline rank {on[s]}, as stage {first}: they need the "
                    f"same ranks (got {list(self.ranks[s])} and {list(self.ranks[first])})"
                )

    @property
    def n_stages(self) -> int:
        """pp · virtual."""
        return self.pp * self.virtual

    @property
    def stage_ranks(self) -> tuple[int, ...]:
        """Per stage, the pipeline rank (0 … pp − 1) running it."""
        return stage_ranks(self.schedule, self.pp, self.virtual)

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
        return in_flight(self.schedule, self.pp, self.micro_batches, stage, self.virtual)


class RangeMax:
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


class BlockTable:
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
        self.copied = [float(x.boundary_copy_bytes) for x in b]
        self.grad_boundary = [  # older profiles: every boundary tensor's gradient
            float(x.boundary_bytes if x.boundary_grad_bytes is None else x.boundary_grad_bytes)
            for x in b
        ]
        self.output = [float(x.output_bytes) for x in b]
        self.loss_fwd = prof.loss_fwd_ms
        self.loss_bwd = prof.loss_bwd_ms
        self.input_bytes = float(prof.input_bytes)
        self.target_bytes = float(prof.target_bytes)
        # [Note: the memory peak], the first backward: after block k's backward the
        # gradients of blocks k.. exist and the activations of blocks ..k still do.
        grads = [p * grad_per_param_byte for p in self.params]
        self.backward_curve = RangeMax([self.act[k + 1] - grads[k] for k in range(self.n)])
        self.grads = grads
        # A later backward: at block k's, the activations of blocks ..k and the new
        # gradient of its parameters (the largest block's, or a tied tensor it uses).
        tied = [0.0] * self.n
        for t in prof.tied:
            for u in t.blocks:
                tied[u] = max(tied[u], float(t.nbytes))
        self.later_curve = RangeMax(
            [
                self.act[k + 1] + grad_per_param_byte * max(float(b[k].param_bytes), tied[k])
                for k in range(self.n)
            ]
        )
        # A block's backward holds its output's gradient and its input's: the sums of
        # neighbouring outputs (the first block of a stage uses the stage's input).
        pairs = [self.output[k] + (self.output[k - 1] if k else 0.0) for k in range(self.n)]
        self.grad_pair = RangeMax([x * act_scale for x in pairs])
        self.max_params = RangeMax([float(x.param_bytes) for x in b])
        self.max_tensor = RangeMax([float(max(x.param_tensors, default=x.param_bytes)) for x in b])
        self.param_tensors = [
            x.param_tensors if x.param_tensors or not x.param_bytes else None for x in b
        ]
        """Per block its parameter tensors' bytes (None: an older profile, unknown)."""
        # [Note: the CPU optimizer step]: parameter tensors, two per module call.
        self.tensors = [0, *accumulate(2 * len(x.modules) if x.param_bytes else 0 for x in b)]
        self._beyond: dict[float, list[float]] = {}

    def beyond(self, size: float) -> list[float]:
        """Prefix sums over the blocks of the parameter bytes in tensors larger than
        ``size`` bytes (a block whose tensors the profile does not list counts whole)."""
        got = self._beyond.get(size)
        if got is None:
            per = []
            for k, tensors in enumerate(self.param_tensors):
                whole = self.params[k + 1] - self.params[k]
                per.append(whole if tensors is None else float(sum(t for t in tensors if t > size)))
            got = self._beyond[size] = [0.0, *accumulate(per)]
        return got


# [Note: FSDP as it runs] With ``dp_mode: fsdp`` the runtime makes each stage module
# one unit of torch's ``fully_shard`` over the stage's replicas, with
# ``reshard_after_forward=False`` (``runtime.fsdp``); torch's pipelining turns the
# gradients' sync off for all but the stage's last backward of the step. Priced per
# replica of a stage of n parameters, tied copies included (a copy is a parameter
# of its stage, sharded alike; their gradients' exchange is as with DDP):
#
# * between steps: a dim-0 shard of every tensor, its optimizer state and its
#   gradient, n/dp each (a shard has ⌈rows/dp⌉ rows: priced n/dp, the rounding left
#   out); :meth:`CostBasis.stepped` is n/dp, the optimizer steps that;
# * from the stage's first forward to its last backward: the weights gathered whole,
#   n·weights_b, beside the shard (and bf16-mixed's cast copy, as with DDP), and the
#   gradients accumulated whole, n·grads_b; the last backward ends with one
#   reduce-scatter whose output, n/dp·grads_b, joins them; then the whole weights and
#   gradients are freed. Under bf16-mixed the gradients reduce in bf16 (``wire_b``,
#   as DDP's all-reduce), and FSDP keeps those accumulated between micro-batches in
#   bf16 (``FSDPParam.to_accumulated_grad_if_needed``): a later backward holds them
#   beside its own fp32 ones, n·(grads_b + wire_b). No DDP buckets; nothing sent
#   after the step (``stage_memory``'s moments);
# * time: the all-gather (n·weights_b) and the reduce-scatter (n·wire_b), each half
#   a ring all-reduce of its bytes, neither overlapped with compute
#   (``StageTime.fsdp_ms``). Both are priced in the stage's tail. The gather precedes
#   the stage's first forward, but the step graph has no figure there; step after
#   step it follows the previous step's tail on the same rank, and where every
#   stage's gather takes as long the two places give the same step (the pipeline
#   starts one gather later; each stage's own gather is done by then); else the
#   tail's is an approximation. The reduce-scatter runs where torch runs it
#   (``perform_reduce_grad``): after the stage's last backward and its gradient's
#   send with GPipe and 1F1B; with several stages per rank, before the rank's next
#   action (the tail leaves that delay out). Stages that exchange tied weights start
#   their tails together, so their reduce-scatters wait for each other's last backward.


class CostBasis:
    """The layout's shared facts, checked (see the module docstring).

    Args:
        profiles: per device type (catalogue key), the model's profile at this
            layout's micro-batch size.
        cluster, training, layout: as named.

    Raises:
        ValueError: a stage's device type has no profile, a profile is for
            another micro-batch size, or the profiles' chains differ.
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
            for s in range(layout.n_stages)
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
        mixed = training.precision == "bf16-mixed"
        self.cast_b = 2.0 if mixed else 0.0
        """Bytes per parameter of autocast's bf16 copy of the weights, during fwd/bwd."""
        self.wire_b = 2.0 if mixed else self.grads_b
        """Bytes per parameter DDP's gradient all-reduce moves (bf16-mixed: in bf16)."""
        self.param_elem = DTYPE_BYTES.get(any_prof.dtype, 4)
        # Activations are profiled in the profile's dtype; bf16-mixed halves fp32 ones.
        self.act_scale = 0.5 if training.precision == "bf16-mixed" and self.param_elem == 4 else 1.0
        self.tables = {
            k: BlockTable(p, self.grads_b / self.param_elem, self.act_scale)
            for k, p in profiles.items()
        }
        self.capacity = [
            min(cluster.devices[r].device.memory_bytes for r in layout.ranks[s])
            * (1 - training.memory_headroom)
            for s in range(layout.n_stages)
        ]
        # (owner block, bytes, user blocks) of each tied set.
        self.tied = [(min(t.blocks), float(t.nbytes), t.blocks) for t in any_prof.tied if t.blocks]
        self._shares: dict[tuple[str, int, int], float] = {}  # [Note: ZeRO-1 shares]

    def table(self, s: int) -> BlockTable:
        """The block table of stage s's (first) device type."""
        return self.tables[self.stage_types[s][0]]

    def tied_in(self, i: int, j: int) -> list[float]:
        """Bytes of each tied tensor that blocks [i, j) use."""
        return [nbytes for _, nbytes, users in self.tied if any(i <= u < j for u in users)]

    def tied_copy_bytes(self, i: int, j: int) -> float:
        """Bytes of tied tensors blocks [i, j) use but whose owner block is elsewhere."""
        return sum(
            nbytes
            for owner, nbytes, users in self.tied
            if not i <= owner < j and any(i <= u < j for u in users)
        )

    def parameters(self, s: int, i: int, j: int) -> float:
        """Parameters (a count) of blocks [i, j), their tied copies excluded."""
        tab = self.table(s)
        return (tab.params[j] - tab.params[i]) / self.param_elem

    def held_parameters(self, s: int, i: int, j: int) -> float:
        """Parameters (a count) stage s holds for blocks [i, j): their own and their tied
        copies (tied tensors owned by a block elsewhere)."""
        return self.parameters(s, i, j) + self.tied_copy_bytes(i, j) / self.param_elem

    @property
    def sharded(self) -> bool:
        """Whether the replicas share the optimizer state out by whole tensors (ZeRO-1)."""
        return self.layout.dp_mode == "zero1"

    @property
    def fsdp(self) -> bool:
        """Whether the replicas shard every parameter ([Note: FSDP as it runs])."""
        return self.layout.dp_mode == "fsdp"

    def stepped(self, s: int, i: int, j: int) -> float:
        """Parameters (a count, tied copies included) whose optimizer state one replica of
        stage s holds and steps: all of them, with ZeRO-1 the largest share, with FSDP
        a shard of each, n / dp in all ([Note: FSDP as it runs]).

        [Note: ZeRO-1 shares] The runtime (``runtime.zero``) gives each of a stage's
        parameter tensors whole to one replica (``planner.plan.shares.owners``:
        largest first, each to the replica holding the fewest bytes so far). The
        largest share is priced: its optimizer state and step, and the weights each
        replica sends the others after the step; gradients stay whole (DDP's
        all-reduce). It is the assignment's own, from the profile's tensors, unless
        Graham's bound for list scheduling, ``n / dp + (1 − 1/dp) · largest``, is
        within 1 % of ``n / dp`` (many small tensors: no need to assign them), or the
        profile is older and lists no tensors (then a block's whole parameters stand
        for its largest).
        """
        n = self.held_parameters(s, i, j)
        if self.fsdp:
            return n / self.layout.dp
        if not self.sharded:
            return n
        key = (self.stage_types[s][0], i, j)  # asked for by memory and time alike: once
        got = self._shares.get(key)
        if got is None:
            got = self._shares[key] = self._largest_share(s, i, j, n)
        return got

    def _largest_share(self, s: int, i: int, j: int, n: float) -> float:
        """The largest replica's parameters (a count) of the stage's ``n`` under ``owners``;
        Graham's bound where it is within 1 % of n / dp, or the tensors are unknown."""
        dp = self.layout.dp
        largest = max([self.table(s).max_tensor(i, j)[0], *self.tied_in(i, j)]) / self.param_elem
        bound = min(n, n / dp + (1 - 1 / dp) * largest)
        if bound <= 1.01 * n / dp:
            return bound
        blocks = self.tables[self.stage_types[s][0]].param_tensors[i:j]
        if any(t is None for t in blocks):
            return bound
        sizes: list[float] = [x for t in blocks for x in t or ()]
        sizes += [nbytes for o, nbytes, users in self.tied if not i <= o < j
                  and any(i <= u < j for u in users)]  # fmt: skip
        return max(share_loads(sizes, self.layout.dp)) / self.param_elem
