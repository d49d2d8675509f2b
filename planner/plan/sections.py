"""The plan's sections: each a typed record of plain numbers and strings.

The model (:class:`ModelInfo`), the cluster (:class:`ClusterRecord`), the
training (:class:`TrainingPlan`) and layout (:class:`LayoutPlan`), each stage
(:class:`StagePlan`, its :class:`StageMemory`), the simulation's inputs
(:class:`StepInputs`), the predicted step (:class:`Predicted`), the solver's
record and the candidates. :class:`~planner.plan.schema.Plan` holds them; the
codec (:mod:`planner.plan.codec`) turns each to plain data and back.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

from planner.plan.codec import FIGURE, SAVED_NOT, Record

__all__ = [
    "DP_MODES",
    "DP_MODE_NAMES",
    "Candidate",
    "ClusterRecord",
    "DeviceGroup",
    "LayoutPlan",
    "LinkRecord",
    "ModelInfo",
    "NodeRecord",
    "Predicted",
    "SolverRecord",
    "StageMemory",
    "StagePlan",
    "StepInputs",
    "TrainingPlan",
    "dp_mode_suffix",
]


# --------------------------------------------------------------------------- the model


@dataclass(frozen=True, kw_only=True)
class ModelInfo(Record):
    """Which model the plan is for.

    Attributes:
        fingerprint: the structural fingerprint (module tree, parameter and
            buffer names, shapes, dtypes); None in a format 1 or 2 file.
        file: the model file, for people ("" when planned from Python).
        parameters: the number of parameters.
        capture: how the graph was captured ("export" or "symbolic_trace").
        blocks: blocks in the profile's chain.
        parameter_shapes: every parameter name (tied ones under each name) and
            its shape: what the runtime compares to say *what* differs.
    """

    fingerprint: str | None
    file: str = ""
    parameters: int = 0
    capture: str = ""
    blocks: int = 0
    parameter_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)


# --------------------------------------------------------------------------- the cluster


@dataclass(frozen=True, kw_only=True)
class DeviceGroup(Record):
    """A run of equal devices inside a node: catalogue ``type``, memory, CPU threads."""

    type: str
    count: int = 1
    memory_bytes: int
    threads: int = 0


@dataclass(frozen=True, kw_only=True)
class NodeRecord(Record):
    """One node: its devices, group by group, in rank order; ``repeat`` identical nodes in a row.

    A cluster of 10,000 equal nodes is one record with ``repeat: 10000``, so the
    plan file stays a few lines long whatever the cluster's size.
    """

    devices: tuple[DeviceGroup, ...]
    repeat: int = 1


@dataclass(frozen=True, kw_only=True)
class LinkRecord(Record):
    """Bytes/s per direction and seconds per transfer, inside a node and between nodes."""

    intra_node_bandwidth: float
    inter_node_bandwidth: float
    intra_node_latency_s: float
    inter_node_latency_s: float


@dataclass(frozen=True, kw_only=True)
class ClusterRecord(Record):
    """The cluster as the plan keeps it: exact units (bytes, bytes/s, seconds).

    ``planner.devices.cluster_file.from_record`` rebuilds the ``Cluster``;
    people write the other form, a cluster file.
    """

    name: str
    backend: str
    nodes: tuple[NodeRecord, ...]
    links: LinkRecord

    def device(self, rank: int) -> DeviceGroup | None:
        """The group that global ``rank`` belongs to (None beyond the last device).

        A binary search over the groups' first ranks (made once): asked for every
        rank of a large cluster, it stays O(log groups) per rank.
        """
        starts, groups = self._starts
        i = bisect.bisect_right(starts, rank) - 1
        return groups[i] if 0 <= rank < starts[-1] and i < len(groups) else None

    @functools.cached_property
    def _starts(self) -> tuple[list[int], list[DeviceGroup]]:
        """The first rank of each group, then the total; and the groups, in rank order."""
        groups = [g for node in self.nodes for _ in range(node.repeat) for g in node.devices]
        return [0, *itertools.accumulate(g.count for g in groups)], groups


# --------------------------------------------------------------------------- the step


@dataclass(frozen=True, kw_only=True)
class TrainingPlan(Record):
    """What one step trains on: the batch, its micro-batching, optimizer, precision, schedule."""

    global_batch: int
    micro_batches: int
    micro_batch_size: int
    optimizer: str
    precision: str
    schedule: str


DP_MODES = ("ddp", "zero1", "fsdp")
"""How data-parallel replicas hold the optimizer state: each all of it (DDP), or each a
share of the parameters' state, its weights sent to the others after the step (ZeRO-1:
[Note: ZeRO-1 shares] in planner.cost.basis), or each a shard of every parameter, its
gradient and its state, the weights gathered for the step's forwards and backwards (FSDP:
[Note: FSDP as it runs] in planner.cost.basis). zero1 and fsdp need dp ≥ 2."""

DP_MODE_NAMES = {"ddp": "DDP", "zero1": "ZeRO-1", "fsdp": "FSDP"}
"""Each of ``DP_MODES`` as people write it (reports, messages)."""


def dp_mode_suffix(dp_mode: str, before: str = ", ") -> str:
    """ ", ZeRO-1" or ", FSDP" (``before`` and the mode's name) after a configuration whose
    replicas share their state out; "" for DDP, the default, named nowhere.

    >>> dp_mode_suffix("fsdp"), dp_mode_suffix("ddp"), dp_mode_suffix("zero1", " ")
    (', FSDP', '', ' ZeRO-1')
    """
    return before + DP_MODE_NAMES[dp_mode] if dp_mode != "ddp" else ""


@dataclass(frozen=True, kw_only=True)
class LayoutPlan(Record):
    """Pipeline depth × data-parallel width, and the stages each pipeline rank runs.

    ``pp`` is the devices of one replica (its pipeline ranks); ``virtual`` the
    stages each of them runs (1 unless the schedule is a multi-stage one:
    ``planner.plan.schedule``), so a replica has pp · virtual stages; stage i
    runs on pipeline rank ``stage_ranks(schedule, pp, virtual)[i]``. ``dp_mode``:
    how the replicas hold the optimizer state, "ddp" (each all of it), "zero1"
    (each a share) or "fsdp" (each a shard of the parameters, gradients and state:
    ``planner.options.DP_MODES``); files without it read as "ddp".
    """

    pp: int
    dp: int
    virtual: int = 1
    dp_mode: str = "ddp"


@dataclass(frozen=True, kw_only=True)
class StageMemory(Record):
    """Predicted peak bytes on one device of a stage, by kind, and the usable capacity.

    See ``planner.cost.stage_memory`` for what each kind holds at the peak.
    """

    params: float = field(metadata=FIGURE)
    grads: float = field(metadata=FIGURE)
    optimizer: float = field(metadata=FIGURE)
    buffers: float = field(metadata=FIGURE)
    comm_buffers: float = field(metadata=FIGURE)
    tied_copies: float = field(metadata=FIGURE)
    activations: float = field(metadata=FIGURE)
    total: float = field(metadata=FIGURE)
    capacity: float = field(metadata=FIGURE)

    @property
    def state(self) -> float:
        """Parameters, gradients and optimizer state."""
        return self.params + self.grads + self.optimizer

    @property
    def other(self) -> float:
        """Buffers, communication buffers and tied copies."""
        return self.buffers + self.comm_buffers + self.tied_copies

    @property
    def share(self) -> float:
        """total / capacity (0 when the capacity is unknown)."""
        return self.total / self.capacity if 0 < self.capacity < float("inf") else 0.0


@dataclass(frozen=True, kw_only=True)
class StagePlan(Record):
    """One pipeline stage.

    Attributes:
        index: 0 is the first stage.
        split_point: FQN of the module call the stage begins with ("" for the
            first stage: it begins with the model's inputs).
        blocks: [first, end) block indices of the profile's chain.
        modules: the module calls the stage holds.
        ranks: the device (cluster rank) running this stage, one per replica.
        device: the device type.
        recompute: activations recomputed in backward instead of kept.
        fwd_ms, bwd_ms: predicted compute per micro-batch (all stages computing).
        send_ms: predicted transfer per micro-batch to the next stage
            (activations forward + gradients back).
        sync_ms: predicted tail of each step: gradient all-reduce (tied copies
            included), then the optimizer step.
        memory: predicted peak bytes by kind, and the usable capacity.
    """

    index: int
    split_point: str
    blocks: tuple[int, int]
    modules: tuple[str, ...]
    ranks: tuple[int, ...]
    device: str
    recompute: bool
    fwd_ms: float = field(metadata=FIGURE)
    bwd_ms: float = field(metadata=FIGURE)
    send_ms: float = field(metadata=FIGURE)
    sync_ms: float = field(metadata=FIGURE)
    memory: StageMemory


@dataclass(frozen=True, kw_only=True)
class StepInputs(Record):
    """What the simulation of one step takes (``planner.cost.simulate``), per stage.

    The plan keeps them so that every report replays the very step it predicts.

    Attributes:
        schedule, micro_batches: as in the training section.
        fwd_ms, bwd_ms: one micro-batch's forward / backward, computing alone.
        link_fwd_ms, link_bwd_ms: per link s → s+1, one micro-batch's
            activations / gradients.
        reduce_ms: DDP's gradient all-reduce inside the stage's last backward.
        tail_ms: after the last backward: the tied weights' exchange and the
            optimizer step (with FSDP also its gather and reduce-scatter).
        speed: ``speed[k − 1]``, the rate of each computing stage while k
            stages compute at once (1.0: as fast as alone).
        join: groups of stages that all-reduce the gradients of tied weights
            in their tails (the report says so; every tail waits for every
            stage's last backward anyway: [Note: the step's agreement]).
        virtual: stages per pipeline rank (``speed`` then counts ranks).
        weight_share: per stage, the share of ``bwd_ms`` a split backward's
            weight part computes (empty: ½, the simulator's default).
    """

    schedule: str
    micro_batches: int
    fwd_ms: tuple[float, ...]
    bwd_ms: tuple[float, ...]
    link_fwd_ms: tuple[float, ...]
    link_bwd_ms: tuple[float, ...]
    reduce_ms: tuple[float, ...]
    tail_ms: tuple[float, ...]
    speed: tuple[float, ...]
    join: tuple[tuple[int, ...], ...] = ()
    virtual: int = 1
    weight_share: tuple[float, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Predicted(Record):
    """The predicted step: the simulation of ``Plan.step``, and its closed form."""

    step_ms: float
    closed_form_ms: float
    samples_per_s: float
    bubble_fraction: float


@dataclass(frozen=True, kw_only=True)
class Candidate(Record):
    """A configuration the search considered.

    ``status``: "chosen", "slower" (solved, lost on time), "faster" (solved and
    predicted faster, but within the robust band of the fastest and less sturdy
    than the chosen one: :class:`~planner.plan.choice.ChoiceRecord`),
    "out_of_memory" (no placement fits), "pruned" (a lower bound already lost, or
    it can be neither the fastest nor the one kept: [Note: robust band]), "timeout".
    ``reason`` says why in words. ``virtual``: stages per pipeline rank; ``dp_mode``:
    as ``LayoutPlan``'s.
    """

    pp: int
    dp: int
    micro_batches: int
    schedule: str
    step_ms: float | None = field(metadata=FIGURE)
    status: str
    reason: str
    virtual: int = 1
    dp_mode: str = "ddp"


@dataclass(frozen=True, kw_only=True)
class SolverRecord(Record):
    """How the chosen placement was found, and what is proven about it.

    Attributes:
        name: "highs" or "cbc" (the MILP solver).
        status: what is proven of ``quantity`` over every contiguous placement
            of the plan's configuration: "optimal" (none is faster), "bounded"
            (none is faster than ``bound_ms``; the search ended with the gap
            open: stages share cores, see [Note: shared cores], or the step
            MILP was too large for the time left) or "time_limit" (the limit
            stopped it first). Plans of versions 1 and 2: "optimal", "time_limit" or
            "heuristic", of their closed form.
        quantity: the figure the status, bound and gap speak of:
            "predicted.step_ms" (the step the plan prints), or
            "predicted.closed_form_ms" in plans of versions 1 and 2.
        method: how it was proven: "milp" (the step MILP), "enumeration"
            (every placement that could be faster was simulated), "bounds" (the
            candidate stages' lower bounds: no placement's largest is below it),
            "bound+simulation" (the MILP's bound on a step that is not a
            longest path, raised by simulating the placements it could not
            rule out); "" in older plans.
        gap: (step − bound) / step, the most the placement can be off optimal.
        bound_ms: the proven lower bound on ``quantity``, in milliseconds.
        solve_s: wall seconds of the chosen configuration's solve, for this
            run only: never saved, so that the same inputs give the same file
            (None once loaded, except from a version 1 file).
        time_limit_s: the limit per configuration.
        n_segments: candidate stages (the MILP's binaries) after pruning.
        note: the solver's own words.
    """

    name: str
    status: str
    quantity: str = "predicted.step_ms"
    method: str = ""
    gap: float | None = field(metadata=FIGURE)
    bound_ms: float | None  # not rounded: a lower bound must stay ≤ the step it bounds
    solve_s: float | None = field(default=None, metadata=SAVED_NOT)
    time_limit_s: float | None
    n_segments: int
    note: str = ""
