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
``solver.solve_s``. All three are read (:mod:`planner.plan.files`). A cluster
node may carry ``repeat`` (that many equal nodes in a row, one record for
them); files that list every node read the same. The ``choice`` section (the
robust band, and the fastest configuration when a sturdier one was chosen:
:mod:`planner.plan.choice`) is optional too: a file without it reads as a plan
of the fastest configuration its search found.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from planner.plan.choice import ChoiceRecord
from planner.plan.codec import decode, encode
from planner.plan.formats import PLAN_VERSION, upgrade
from planner.plan.records import ModelProfile
from planner.plan.schedule import schedule_problem, stage_ranks
from planner.plan.sections import (
    DP_MODE_NAMES,
    Candidate,
    ClusterRecord,
    LayoutPlan,
    ModelInfo,
    Predicted,
    SolverRecord,
    StagePlan,
    StepInputs,
    TrainingPlan,
)

__all__ = ["QUANTITIES", "Plan", "PlanError", "check_consistent", "plan_summary"]


class PlanError(ValueError):
    """A plan file is malformed, of an unknown version, or inconsistent."""


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
    choice: ChoiceRecord | None = None
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
    def virtual(self) -> int:
        """Stages per pipeline rank (``len(stages) == pp · virtual``)."""
        return self.layout.virtual

    @property
    def dp_mode(self) -> str:  # "ddp", "zero1" or "fsdp": planner.plan.sections.DP_MODES
        return self.layout.dp_mode

    @property
    def stage_ranks(self) -> tuple[int, ...]:
        """Per stage, the pipeline rank (0 … pp − 1) that runs it."""
        return stage_ranks(self.schedule, self.pp, self.virtual)

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
        """``ranks()[r][s]``: the rank running stage s of replica r (the same rank for
        the stages of one pipeline rank)."""
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

    if plan.pp < 1 or plan.dp < 1 or plan.virtual < 1:
        raise err(
            f"layout.pp, layout.dp and layout.virtual must be ≥ 1 "
            f"(got {plan.pp}, {plan.dp}, {plan.virtual})"
        )
    if len(plan.stages) != plan.pp and plan.virtual == 1:
        raise err(f"layout.pp is {plan.pp} but stages lists {len(plan.stages)} stages")
    if len(plan.stages) != plan.pp * plan.virtual:
        raise err(
            f"layout.pp × layout.virtual is {plan.pp} × {plan.virtual} but stages lists "
            f"{len(plan.stages)} stages"
        )
    problem = schedule_problem(plan.schedule, plan.pp, plan.micro_batches, plan.virtual)
    if problem is not None and plan.virtual > 1:
        raise err(f"training.schedule: {problem[0]}; fix: {problem[1]}")
    if plan.dp_mode not in DP_MODE_NAMES or (plan.dp_mode != "ddp" and plan.dp == 1):
        raise err(
            f"layout.dp_mode {plan.dp_mode!r} with layout.dp {plan.dp}: choose one of "
            f"{', '.join(DP_MODE_NAMES)}; zero1 and fsdp shard state among replicas (dp ≥ 2)"
        )
    tr = plan.training
    small = [
        f"training.{key} {getattr(tr, key)}"
        for key in ("global_batch", "micro_batches", "micro_batch_size")
        if getattr(tr, key) < 1
    ]
    if small:
        raise err(
            f"{', '.join(small)}: must be ≥ 1 (a step trains at least one micro-batch of one "
            "sample on each replica); fix the value or re-plan (planner plan --batch-size N)"
        )
    if tr.global_batch != plan.dp * tr.micro_batches * tr.micro_batch_size:
        raise err(
            f"training.global_batch {tr.global_batch} ≠ dp × micro_batches × "
            f"micro_batch_size = {plan.dp} × {tr.micro_batches} × {tr.micro_batch_size}"
        )
    prev_end = _check_stages(plan, err)
    if plan.profiles and prev_end != len(plan.profiles[0].blocks):
        raise err(
            f"the stages cover blocks 0..{prev_end - 1} but the profile has "
            f"{len(plan.profiles[0].blocks)} blocks"
        )
    if plan.step is not None:
        _check_step(plan.step, plan, err)
    _check_solver(plan, err)
    _check_choice(plan, err)


def _check_stages(plan: Plan, err: Callable[[str], PlanError]) -> int:
    """Each stage's index, blocks, split point, modules and ranks; returns where they end."""
    seen: set[int] = set()
    held: dict[int, tuple[int, ...]] = {}  # per pipeline rank, its devices
    on = plan.stage_ranks
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
        _check_stage_modules(plan, k, err)
        if on[k] in held:  # another stage of the same pipeline rank: the same devices
            if tuple(st.ranks) != held[on[k]]:
                raise err(
                    f"{where}.ranks {list(st.ranks)} differ from {list(held[on[k]])}, those of "
                    f"the other stages of pipeline rank {on[k]} ({plan.schedule}, "
                    f"{plan.virtual} stages per rank)"
                )
            continue
        dup = seen & set(st.ranks)
        if dup:
            raise err(f"{where}.ranks reuses rank(s) {sorted(dup)} already used by another stage")
        seen |= set(st.ranks)
        held[on[k]] = tuple(st.ranks)
    if seen != set(range(plan.world_size)):
        raise err(
            f"the stages' ranks must be exactly 0..{plan.world_size - 1} "
            f"(pp × dp = {plan.pp} × {plan.dp}); got {sorted(seen)}"
        )
    return prev_end


def _check_stage_modules(plan: Plan, k: int, err: Callable[[str], PlanError]) -> None:
    """Stage ``k``'s split point, blocks and modules tell one story.

    The planner writes (``planner.planning.stage_plans``) a stage's modules as
    those of its blocks, in order, and its split point as the name of its
    first block (the first module call the stage runs; "" for stage 0). The
    runtime splits at the split points alone, so an edit of one that the
    others do not follow would run a placement the plan did not predict.
    Without a profile, only the split point against the modules is checked
    (a stage whose blocks hold no module call has none: the planner writes such
    stages, e.g. torchvision's ViT-B/16 at pp 4).
    """
    st, where = plan.stages[k], f"stages[{k}]"
    fix = "edit split_point, blocks and modules together, or re-plan"
    if k == 0:
        if st.split_point:
            raise err(
                f"{where}.split_point is {st.split_point!r}; the first stage starts at the "
                'model\'s inputs, so it must be empty ("")'
            )
    elif st.modules and not _nested(st.split_point, st.modules[0]):
        # A stage's blocks may hold no module call (only functions: a ViT's encoder input
        # after its split point), or its split point may name the parent of its first call.
        raise err(
            f"{where}.split_point {st.split_point!r} is not the stage's first module call "
            f"(modules[0] is {st.modules[0]!r}); {fix}"
        )
    if not plan.profiles:
        return
    blocks = plan.profiles[0].blocks
    i, j = st.blocks
    if j > len(blocks):
        return  # the coverage check names it, with the profile's block count
    if k > 0 and st.split_point != blocks[i].name:
        raise err(
            f"{where}.split_point is {st.split_point!r} but its first block, {i}, starts at "
            f"{blocks[i].name!r} (profiles[0].blocks[{i}].name); {fix}"
        )
    want = [m for b in blocks[i:j] for m in b.modules]
    if list(st.modules) != want:
        extra = [m for m in st.modules if m not in want]
        missing = [m for m in want if m not in st.modules]
        diff = f"not in its blocks {extra[:3]}" if extra else ""
        diff += ("; " if diff and missing else "") + (f"missing {missing[:3]}" if missing else "")
        raise err(
            f"{where}.modules ({len(st.modules)}) are not those of its blocks {list(st.blocks)} "
            f"({len(want)} in profiles[0].blocks[{i}:{j}]): {diff or 'another order'}; {fix}"
        )


QUANTITIES = ("predicted.step_ms", "predicted.closed_form_ms")
"""What a plan's solver record may speak of: the printed step, or (older plans) the closed form."""


def _check_solver(plan: Plan, err: Callable[[str], PlanError]) -> None:
    sv = plan.solver
    if sv.quantity not in QUANTITIES:
        raise err(f"solver.quantity is {sv.quantity!r}; expected one of {', '.join(QUANTITIES)}")
    if sv.quantity == QUANTITIES[0] and sv.bound_ms is not None:
        step = plan.predicted.step_ms
        if sv.bound_ms > step * (1 + 1e-9) + 1e-12:
            raise err(
                f"solver.bound_ms {sv.bound_ms!r} exceeds predicted.step_ms {step!r}: a lower "
                "bound on the step cannot be above it"
            )


def _check_choice(plan: Plan, err: Callable[[str], PlanError]) -> None:
    fastest = plan.choice.fastest if plan.choice is not None else None
    step = plan.predicted.step_ms
    if fastest is not None and fastest.step_ms > step * (1 + 1e-5):  # figures: 6 digits
        raise err(
            f"choice.fastest.step_ms {fastest.step_ms!r} exceeds predicted.step_ms {step!r}: "
            "the fastest configuration cannot be slower than the plan's"
        )


def _check_step(step: StepInputs, plan: Plan, err: Callable[[str], PlanError]) -> None:
    p = len(plan.stages)
    if (step.schedule, step.micro_batches, step.virtual) != (
        plan.schedule,
        plan.micro_batches,
        plan.virtual,
    ):
        raise err(
            f"step is for {step.schedule} with {step.micro_batches} micro-batches and "
            f"{step.virtual} stage(s) per rank, the plan trains {plan.schedule} with "
            f"{plan.micro_batches} and {plan.virtual}"
        )
    want = {"fwd_ms": p, "bwd_ms": p, "link_fwd_ms": p - 1, "link_bwd_ms": p - 1}
    want |= {"reduce_ms": p, "tail_ms": p, "speed": plan.pp}
    if step.weight_share:
        want["weight_share"] = p
    for name, n in want.items():
        got = len(getattr(step, name))
        if got != n:
            raise err(f"step.{name} has {got} entries, expected {n} ({p} stages, pp {plan.pp})")
    if not all(x > 0 for x in step.speed):
        raise err(f"step.speed entries must be > 0, got {list(step.speed)}")
    bad = sorted({s for group in step.join for s in group if not 0 <= s < p})
    if bad:
        raise err(f"step.join names stage(s) {bad}, beyond the {p} stages")


def plan_summary(plan: Plan) -> str:
    """One line: 'pp 2 × dp 4, 8 micro-batches (gpipe), 123.4 ms/step'."""
    sched = plan.schedule + (f", {plan.virtual} stages per rank" if plan.virtual > 1 else "")
    mode = f" ({DP_MODE_NAMES[plan.dp_mode]})" if plan.dp_mode != "ddp" else ""
    return (
        f"pp {plan.pp} × dp {plan.dp}{mode}, {plan.micro_batches} micro-batches ({sched}), "
        f"{plan.predicted.step_ms:.1f} ms/step"
    )


def _nested(a: str, b: str) -> bool:
    """Whether module paths ``a`` and ``b`` are the same, or one lies inside the other."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")
