"""The plan: a placement a person can read and edit, saved as versioned YAML.

A plan holds everything needed to run it and to re-check or re-solve it
without the model: the model's fingerprint, the cluster, the batch and
micro-batching, each stage's split point, modules, blocks and ranks, the
predicted time and memory of every stage, the solver's record, the candidates
that lost and why, and the per-block profiles it was solved on.

Files are read with ``yaml.safe_load`` only (no Python tags) and validated
against the schema in :mod:`planner.plan_schema`; errors name the key path and
the expected type. The runtime imports this module (with ``plan_schema``) and
``records`` only.

[Note: reproducible plan files] The same inputs (model file, cluster, options
and profile; an analytic device type, or a measured profile reused from the
cache) give a byte-identical plan file. So the file holds nothing that depends
on the run: no wall-clock time (``SolverRecord.solve_s`` is kept in memory,
never saved; the CLI prints how long planning took), keys in a fixed order, floats
rounded to 6 significant digits. The search is deterministic: configurations
in a fixed order, HiGHS with a fixed seed, and one answer among placements of
equal step time ([Note: tie-breaking] in :mod:`planner.solve.feasible`). One
exception: a solve stopped by ``--time-limit`` keeps whatever it had found by
then, which depends on the machine's speed; the plan then says
``status: time_limit``. (Plans for local CPU devices also depend on the CPU's
speed, measured in each process.)

Format versions: 1 also recorded ``solver.solve_s``; 2 (written now) does not.
Both are read.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from planner.records import ModelProfile

__all__ = [
    "PLAN_VERSION",
    "SUPPORTED_VERSIONS",
    "Candidate",
    "Plan",
    "PlanError",
    "SolverRecord",
    "StagePlan",
    "load_plan",
    "save_plan",
]

PLAN_VERSION = 2
SUPPORTED_VERSIONS = (1, 2)


class PlanError(ValueError):
    """A plan file is malformed, of an unknown version, or inconsistent."""


@dataclass(frozen=True, kw_only=True)
class StagePlan:
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
        fwd_ms, bwd_ms: predicted compute per micro-batch.
        send_ms: predicted transfer per micro-batch to the next stage
            (activations forward + gradients back).
        sync_ms: predicted tail of each step: gradient all-reduce (tied copies
            included), then the optimizer step.
        memory: predicted peak bytes by kind (params, grads, optimizer,
            buffers, comm_buffers, tied_copies, activations, total) and the
            device's usable ``capacity``.
    """

    index: int
    split_point: str
    blocks: tuple[int, int]
    modules: tuple[str, ...]
    ranks: tuple[int, ...]
    device: str
    recompute: bool
    fwd_ms: float
    bwd_ms: float
    send_ms: float
    sync_ms: float
    memory: Mapping[str, float]


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """A configuration the search considered.

    ``status``: "chosen", "slower" (solved, lost on time), "out_of_memory"
    (no placement fits), "pruned" (a lower bound already lost), "infeasible"
    (e.g. more stages than split points). ``reason`` says why in words.
    """

    pp: int
    dp: int
    micro_batches: int
    schedule: str
    step_ms: float | None
    status: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class SolverRecord:
    """How the chosen placement was found and how sure we are of it.

    Attributes:
        name: "highs" or "cbc".
        status: "optimal" (proven), "time_limit" (the limit stopped the solver;
            the best placement found by then) or "heuristic" (the solver ended
            otherwise without a better placement; the heuristic's).
        gap: (step − bound) / step, the most the placement can be off optimal.
        bound_ms: the proven lower bound on the step time.
        solve_s: wall seconds of the chosen configuration's solve, for this
            run only: not saved, so that the same inputs give the same file
            (None once loaded, except from a version 1 file).
        time_limit_s: the limit per solve.
        n_segments: binaries in the ILP after pruning.
        note: e.g. how the ILP's placement was refined by simulation.
    """

    name: str
    status: str
    gap: float | None
    bound_ms: float | None
    solve_s: float | None = None
    time_limit_s: float | None
    n_segments: int
    note: str = ""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A placement of a model on a cluster. See the module docstring."""

    version: int = PLAN_VERSION
    model: Mapping[str, Any]  # fingerprint, file, parameters, capture
    cluster: Mapping[str, Any]  # Cluster.to_dict()
    global_batch: int
    micro_batches: int
    micro_batch_size: int
    optimizer: str
    precision: str
    schedule: str
    pp: int
    dp: int
    stages: tuple[StagePlan, ...]
    predicted: Mapping[str, float]  # step_ms, closed_form_ms, samples_per_s, bubble_fraction
    solver: SolverRecord
    candidates: tuple[Candidate, ...] = ()
    profiles: tuple[ModelProfile, ...] = ()
    warnings: tuple[str, ...] = field(default=())
    parameter_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def fingerprint(self) -> str:
        return str(self.model["fingerprint"])

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    @property
    def split_points(self) -> list[str]:
        return [s.split_point for s in self.stages[1:]]

    def ranks(self) -> list[list[int]]:
        """``ranks()[r][s]``: the rank running stage s of replica r."""
        return [[st.ranks[r] for st in self.stages] for r in range(self.dp)]

    # ----------------------------------------------------------------- dict form

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": PLAN_VERSION,  # the dict (and the file) is always in the current format
            "model": dict(self.model),
            "cluster": dict(self.cluster),
            "training": {
                "global_batch": self.global_batch,
                "micro_batches": self.micro_batches,
                "micro_batch_size": self.micro_batch_size,
                "optimizer": self.optimizer,
                "precision": self.precision,
                "schedule": self.schedule,
            },
            "layout": {"pp": self.pp, "dp": self.dp},
            "stages": [
                {
                    "index": s.index,
                    "split_point": s.split_point,
                    "blocks": list(s.blocks),
                    "modules": list(s.modules),
                    "ranks": list(s.ranks),
                    "device": s.device,
                    "recompute": s.recompute,
                    "fwd_ms": _num(s.fwd_ms),
                    "bwd_ms": _num(s.bwd_ms),
                    "send_ms": _num(s.send_ms),
                    "sync_ms": _num(s.sync_ms),
                    "memory": {k: _num(v) for k, v in s.memory.items()},
                }
                for s in self.stages
            ],
            "predicted": {k: _num(v) for k, v in self.predicted.items()},
            "solver": {
                "name": self.solver.name,
                "status": self.solver.status,
                "gap": _num(self.solver.gap),
                "bound_ms": _num(self.solver.bound_ms),
                # No solve_s: see [Note: reproducible plan files].
                "time_limit_s": self.solver.time_limit_s,
                "n_segments": self.solver.n_segments,
                "note": self.solver.note,
            },
            "candidates": [
                {
                    "pp": c.pp,
                    "dp": c.dp,
                    "micro_batches": c.micro_batches,
                    "schedule": c.schedule,
                    "step_ms": _num(c.step_ms),
                    "status": c.status,
                    "reason": c.reason,
                }
                for c in self.candidates
            ],
            "warnings": list(self.warnings),
            # What the runtime compares to say *what* differs when the fingerprint does not.
            "parameter_shapes": {k: list(v) for k, v in self.parameter_shapes.items()},
            "profiles": [p.to_dict() for p in self.profiles],
        }

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "plan") -> Plan:
        """Validate ``data`` against the schema and build the plan."""
        # plan_schema imports this module (PlanError, the versions): reach it at call time.
        from planner.plan_schema import _check, _check_consistent, _check_version, schema

        if isinstance(data, Mapping):
            _check_version(data, source)
            _check(data, schema(data["version"]), source)
        else:
            _check(data, schema(PLAN_VERSION), source)  # names what was expected
        version = data["version"]
        tr, lay = data["training"], data["layout"]
        stages = tuple(
            StagePlan(
                index=s["index"],
                split_point=s["split_point"],
                blocks=(s["blocks"][0], s["blocks"][1]),
                modules=tuple(s["modules"]),
                ranks=tuple(s["ranks"]),
                device=s["device"],
                recompute=s["recompute"],
                fwd_ms=s["fwd_ms"],
                bwd_ms=s["bwd_ms"],
                send_ms=s["send_ms"],
                sync_ms=s["sync_ms"],
                memory=dict(s["memory"]),
            )
            for s in data["stages"]
        )
        sv = data["solver"]
        plan = cls(
            version=version,
            model=dict(data["model"]),
            cluster=dict(data["cluster"]),
            global_batch=tr["global_batch"],
            micro_batches=tr["micro_batches"],
            micro_batch_size=tr["micro_batch_size"],
            optimizer=tr["optimizer"],
            precision=tr["precision"],
            schedule=tr["schedule"],
            pp=lay["pp"],
            dp=lay["dp"],
            stages=stages,
            predicted=dict(data["predicted"]),
            solver=SolverRecord(
                name=sv["name"],
                status=sv["status"],
                gap=sv["gap"],
                bound_ms=sv["bound_ms"],
                solve_s=sv.get("solve_s"),  # version 1 files only
                time_limit_s=sv["time_limit_s"],
                n_segments=sv["n_segments"],
                note=sv.get("note") or "",
            ),
            candidates=tuple(Candidate(**c) for c in data.get("candidates") or ()),
            profiles=tuple(
                _profile(p, f"{source}.profiles[{k}]")
                for k, p in enumerate(data.get("profiles") or ())
            ),
            warnings=tuple(data.get("warnings") or ()),
            parameter_shapes={k: tuple(v) for k, v in (data.get("parameter_shapes") or {}).items()},
        )
        _check_consistent(plan, source)
        return plan


def save_plan(plan: Plan, path: str | os.PathLike[str]) -> Path:
    """Write ``plan`` as YAML, atomically (a temporary file renamed into place).

    The same plan always gives the same bytes: see [Note: reproducible plan files].

    Raises:
        PlanError: the file cannot be written (the message says why and what to do).
    """
    path = Path(path)
    text = _plan_text(plan)
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        raise PlanError(
            f"cannot write the plan to {path}: {exc.strerror or exc}; "
            "choose another --out path (a file in a folder you can write to)"
        ) from exc
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    return path


def _plan_text(plan: Plan) -> str:
    """The plan file's text (what :func:`save_plan` writes)."""
    body = yaml.dump(plan.to_dict(), Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=100)
    return _HEADER + body


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Read and validate a plan file.

    Example::

        plan = load_plan("plan.yaml")
        print(plan.pp, plan.dp, plan.split_points)

    Raises:
        PlanError: the file is missing, not YAML, uses Python tags, is of an
            unknown version, or does not match the schema (the message names
            the key path and the expected type).
    """
    path = Path(path)
    if not path.is_file():
        raise PlanError(
            f"plan file {path} not found; create one with `planner plan model.py --out {path}`"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanError(
            f"cannot read the plan file {path}: {exc}; check its permissions, or regenerate "
            "it with `planner plan`"
        ) from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PlanError(
            f"{path} is not a valid plan file: {exc}\n"
            "Plan files are plain YAML (no Python tags); regenerate it with `planner plan`."
        ) from exc
    return Plan.from_dict(data, source=str(path))


class _Dumper(yaml.SafeDumper):
    """Safe YAML with short lists of numbers/strings on one line ("ranks: [0, 2]")."""


def _represent_list(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.Node:
    flat = all(isinstance(x, (int, float, str, bool)) or x is None for x in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flat)


_Dumper.add_representer(list, _represent_list)


_HEADER = (
    "# Placement plan written by `planner plan`. Human-readable and editable;\n"
    "# `planner show` re-renders it, `planner run` executes it.\n"
)


def _num(x: float | None) -> float | None:
    """Floats rounded to 6 significant digits (readable, stable across platforms)."""
    if x is None:
        return None
    if not math.isfinite(x):
        return float(x)
    return float(f"{x:.6g}")


def _profile(data: Any, where: str) -> ModelProfile:
    if not isinstance(data, Mapping):
        raise PlanError(f"{where}: expected a mapping (a profile), got {type(data).__name__}")
    try:
        return ModelProfile.from_dict(dict(data))
    except (KeyError, TypeError, ValueError) as exc:
        raise PlanError(f"{where}: not a valid profile ({exc})") from exc


def plan_summary(plan: Plan) -> str:
    """One line: 'pp 2 × dp 4, 8 micro-batches (gpipe), 123.4 ms/step'."""
    return (
        f"pp {plan.pp} × dp {plan.dp}, {plan.micro_batches} micro-batches ({plan.schedule}), "
        f"{plan.predicted['step_ms']:.1f} ms/step"
    )
