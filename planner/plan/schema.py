"""The plan: a placement a person can read and edit, as typed sections.

A plan holds everything needed to run it and to re-check or re-solve it
without the model: the model's identity, the cluster, the batch and
micro-batching, each stage's split point, modules, blocks and ranks, the
predicted time and memory of every stage, the inputs of the simulated step
(so that every report draws exactly the step the plan predicts), the solver's
record, the candidates that lost and why, and the per-block profiles it was
solved on. Its plain-data form (:meth:`Plan.to_dict`, the file) follows the
sections below; :mod:`planner.plan.codec` derives it from the dataclasses.

[Note: reproducible plan files] The same inputs (model file, cluster, options
and profile; an analytic device type, or a measured profile reused from the
cache) give a byte-identical plan file. So the file holds nothing that depends
on the run: no wall-clock time (``SolverRecord.solve_s`` is kept in memory,
never saved; the CLI prints how long planning took), keys in a fixed order,
figures for people rounded to 6 significant digits (the simulation's inputs
and the predicted step exactly, so that replaying them gives the same step bit
for bit). The search is deterministic: configurations in a fixed order, HiGHS
with a fixed seed, and one answer among placements of equal step time ([Note:
tie-breaking] in :mod:`planner.solve.feasible`). One exception: a solve stopped
by ``--time-limit`` keeps whatever it had found by then, which depends on the
machine's speed; the plan then says ``status: time_limit``. (Plans for local
CPU devices also depend on the CPU's speed, measured once per machine.)

Format versions: 3 (written now) identifies the model by its structural
fingerprint (:mod:`planner.plan.fingerprint`) and records the simulation's
inputs; 2 and 1 identified it by a hash of its traced graph, which nothing
computes any more: their fingerprint reads as None, and the runtime checks
such plans by their parameter names and shapes. 1 also recorded
``solver.solve_s``. All three are read (:mod:`planner.plan.files`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from planner.plan.codec import FIGURE, SAVED_NOT, Record, decode, encode
from planner.plan.formats import PLAN_VERSION, SUPPORTED_VERSIONS, upgrade
from planner.plan.records import ModelProfile

__all__ = [
    "PLAN_VERSION",
    "SUPPORTED_VERSIONS",
    "Candidate",
    "ClusterRecord",
    "DeviceGroup",
    "LayoutPlan",
    "LinkRecord",
    "ModelInfo",
    "NodeRecord",
    "Plan",
    "PlanError",
    "Predicted",
    "SolverRecord",
    "StageMemory",
    "StagePlan",
    "StepInputs",
    "TrainingPlan",
    "plan_summary",
]


class PlanError(ValueError):
    """A plan file is malformed, of an unknown version, or inconsistent."""


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
    """One node: its devices, group by group, in rank order."""

    devices: tuple[DeviceGroup, ...]


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
        """The group that global ``rank`` belongs to (None beyond the last device)."""
        k = 0
        for node in self.nodes:
            for group in node.devices:
                if rank < k + group.count:
                    return group
                k += group.count
        return None


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


@dataclass(frozen=True, kw_only=True)
class LayoutPlan(Record):
    """Pipeline depth × data-parallel width."""

    pp: int
    dp: int


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
            optimizer step.
        speed: ``speed[k − 1]``, the rate of each computing stage while k
            stages compute at once (1.0: as fast as alone).
        join: groups of stages whose tails start together (they all-reduce
            the gradients of tied weights).
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

    ``status``: "chosen", "slower" (solved, lost on time), "out_of_memory"
    (no placement fits), "pruned" (a lower bound already lost), "timeout".
    ``reason`` says why in words.
    """

    pp: int
    dp: int
    micro_batches: int
    schedule: str
    step_ms: float | None = field(metadata=FIGURE)
    status: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class SolverRecord(Record):
    """How the chosen placement was found and how sure we are of it.

    Attributes:
        name: "highs" or "cbc".
        status: "optimal" (proven), "time_limit" (the limit stopped the solver;
            the best placement found by then) or "heuristic" (the solver ended
            otherwise without a better placement; the heuristic's).
        gap: (step − bound) / step, the most the placement can be off optimal.
        bound_ms: the proven lower bound on the step time.
        solve_s: wall seconds of the chosen configuration's solve, for this
            run only: never saved, so that the same inputs give the same file
            (None once loaded, except from a version 1 file).
        time_limit_s: the limit per solve.
        n_segments: binaries in the ILP after pruning.
        note: e.g. how the ILP's placement was refined by simulation.
    """

    name: str
    status: str
    gap: float | None = field(metadata=FIGURE)
    bound_ms: float | None = field(metadata=FIGURE)
    solve_s: float | None = field(default=None, metadata=SAVED_NOT)
    time_limit_s: float | None
    n_segments: int
    note: str = ""


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A placement of a model on a cluster. See the module docstring.

    ``version`` is the format the plan was read from (the current one for a new
    plan); :meth:`to_dict` always writes the current format.
    """

    version: int = PLAN_VERSION
    model: ModelInfo
    cluster: ClusterRecord
    training: TrainingPlan
    layout: LayoutPlan
    stages: tuple[StagePlan, ...]
    predicted: Predicted
    step: StepInputs | None = None
    solver: SolverRecord
    candidates: tuple[Candidate, ...] = ()
    warnings: tuple[str, ...] = ()
    profiles: tuple[ModelProfile, ...] = ()

    # The training and layout fields, read through the plan itself.
    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def global_batch(self) -> int:
        return self.training.global_batch

    @property
    def micro_batches(self) -> int:
        return self.training.micro_batches

    @property
    def micro_batch_size(self) -> int:
        return self.training.micro_batch_size

    @property
    def optimizer(self) -> str:
        return self.training.optimizer

    @property
    def precision(self) -> str:
        return self.training.precision

    @property
    def schedule(self) -> str:
        return self.training.schedule

    @property
    def fingerprint(self) -> str | None:
        return self.model.fingerprint

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    @property
    def split_points(self) -> list[str]:
        return [s.split_point for s in self.stages[1:]]

    def ranks(self) -> list[list[int]]:
        """``ranks()[r][s]``: the rank running stage s of replica r."""
        return [[st.ranks[r] for st in self.stages] for r in range(self.dp)]

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain data, in the current format (what the file holds)."""
        out = encode(self)
        out["version"] = PLAN_VERSION
        return out

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "plan") -> Plan:
        """Validate ``data`` (any supported format) and build the plan.

        Raises:
            PlanError: an unknown version, a key or value that does not fit the
                schema (the message names the key path and the expected type),
                or fields that contradict each other.
        """
        current, solve_s = upgrade(data, source, PlanError)
        plan = decode(cls, current, path=source, error=PlanError)
        if solve_s is not None:  # a version 1 file's wall time, kept in memory only
            solver = dataclasses.replace(plan.solver, solve_s=solve_s)
            plan = dataclasses.replace(plan, solver=solver)
        check_consistent(plan, source)
        return plan


def check_consistent(plan: Plan, path: str) -> None:
    """Cross-field rules the types alone cannot state.

    Raises:
        PlanError: the first rule broken, with the numbers.
    """

    def err(msg: str) -> PlanError:
        return PlanError(f"{path}: {msg}")

    if plan.pp < 1 or plan.dp < 1:
        raise err(f"layout.pp and layout.dp must be ≥ 1 (got {plan.pp}, {plan.dp})")
    if len(plan.stages) != plan.pp:
        raise err(f"layout.pp is {plan.pp} but stages lists {len(plan.stages)} stages")
    tr = plan.training
    if tr.global_batch != plan.dp * tr.micro_batches * tr.micro_batch_size:
        raise err(
            f"training.global_batch {tr.global_batch} ≠ dp × micro_batches × "
            f"micro_batch_size = {plan.dp} × {tr.micro_batches} × {tr.micro_batch_size}"
        )
    seen: set[int] = set()
    prev_end = 0
    for k, st in enumerate(plan.stages):
        where = f"stages[{k}]"
        if st.index != k:
            raise err(f"{where}.index is {st.index}, expected {k}")
        if len(st.ranks) != plan.dp:
            raise err(f"{where}.ranks has {len(st.ranks)} ranks, expected dp = {plan.dp}")
        if st.blocks[0] != prev_end or st.blocks[1] <= st.blocks[0]:
            raise err(
                f"{where}.blocks {list(st.blocks)} must start at {prev_end} (where the previous "
                "stage ends) and hold at least one block"
            )
        prev_end = st.blocks[1]
        if k > 0 and not st.split_point:
            raise err(f"{where}.split_point is empty; every stage after the first needs one")
        dup = seen & set(st.ranks)
        if dup:
            raise err(f"{where}.ranks reuses rank(s) {sorted(dup)} already used by another stage")
        seen |= set(st.ranks)
    if seen != set(range(plan.world_size)):
        raise err(
            f"the stages' ranks must be exactly 0..{plan.world_size - 1} "
            f"(pp × dp = {plan.pp} × {plan.dp}); got {sorted(seen)}"
        )
    if plan.profiles and prev_end != len(plan.profiles[0].blocks):
        raise err(
            f"the stages cover blocks 0..{prev_end - 1} but the profile has "
            f"{len(plan.profiles[0].blocks)} blocks"
        )
    if plan.step is not None:
        _check_step(plan.step, plan, err)


def _check_step(step: StepInputs, plan: Plan, err: Callable[[str], PlanError]) -> None:
    p = plan.pp
    if (step.schedule, step.micro_batches) != (plan.schedule, plan.micro_batches):
        raise err(
            f"step is for {step.schedule} with {step.micro_batches} micro-batches, the plan "
            f"trains {plan.schedule} with {plan.micro_batches}"
        )
    want = {"fwd_ms": p, "bwd_ms": p, "link_fwd_ms": p - 1, "link_bwd_ms": p - 1}
    want |= {"reduce_ms": p, "tail_ms": p, "speed": p}
    for name, n in want.items():
        got = len(getattr(step, name))
        if got != n:
            raise err(f"step.{name} has {got} entries, expected {n} (pp = {p})")
    if not all(x > 0 for x in step.speed):
        raise err(f"step.speed entries must be > 0, got {list(step.speed)}")
    bad = sorted({s for group in step.join for s in group if not 0 <= s < p})
    if bad:
        raise err(f"step.join names stage(s) {bad}, beyond the {p} stages")


def plan_summary(plan: Plan) -> str:
    """One line: 'pp 2 × dp 4, 8 micro-batches (gpipe), 123.4 ms/step'."""
    return (
        f"pp {plan.pp} × dp {plan.dp}, {plan.micro_batches} micro-batches ({plan.schedule}), "
        f"{plan.predicted.step_ms:.1f} ms/step"
    )
