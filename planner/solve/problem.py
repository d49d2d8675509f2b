"""The partition problem and its answer: PartitionProblem, PartitionSolution, the errors."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "SOLVERS",
    "CutFn",
    "PartitionInfeasible",
    "PartitionProblem",
    "PartitionSolution",
    "PartitionTimeout",
    "SegFn",
    "SolverUnavailable",
    "Status",
    "block_label",
    "format_bytes",
    "placement_indices",
    "unfit_block",
    "unfit_last",
    "unfit_stage",
    "unfit_whole",
]

SOLVERS = ("auto", "highs", "cbc")
"""The solvers a partition can be solved with ("auto": HiGHS when installed, else CBC)."""

SegFn = Callable[[int, int, int], float]
CutFn = Callable[[int, int], float]
Status = Literal["optimal", "time_limit", "heuristic"]


class PartitionInfeasible(ValueError):
    """No placement satisfies the memory and split-point constraints."""


class PartitionTimeout(RuntimeError):
    """The time limit ran out before any placement was found."""


class SolverUnavailable(RuntimeError):
    """The requested ILP solver is not installed."""


def _zero_cut(s: int, j: int) -> float:
    return 0.0


def _zero_seg(s: int, i: int, j: int) -> float:
    return 0.0


@dataclass(frozen=True, kw_only=True)
class PartitionProblem:
    """A chain of blocks to place on pipeline stages.

    Every callable takes stage indices and block indices; ``[i, j)`` is the run
    of blocks a stage holds. Work and sync must be non-decreasing in j and
    non-increasing in i (a longer run never costs less), and so must "fits in
    memory" (memory itself may drop, e.g. when recompute kicks in, as long as
    a run that does not fit never fits once extended): the pruning relies on it.

    Attributes:
        n_blocks: blocks in the chain (≥ 1).
        n_stages: pipeline stages S (≥ 1); each gets ≥ 1 block, in order.
        micro_batches: m ≥ 1 micro-batches per step.
        seg_work: (s, i, j) -> per-micro-batch time of stage s holding [i, j).
        seg_memory: (s, i, j) -> peak bytes of stage s holding [i, j).
        capacity: bytes each stage's device holds (``math.inf``: no limit).
        cut_time: (s, j) -> per-micro-batch transfer time on the link s → s+1
            when stage s+1 starts at block j (1 ≤ j ≤ n−1). Default: free.
        seg_sync: (s, i, j) -> exposed gradient all-reduce time of stage s
            holding [i, j); 0 when dp = 1 (the default).
        allowed_starts: blocks where a stage may start; block 0 always starts
            stage 0. None: every block.
        stage_class: per stage, a label; stages with equal labels have
            identical seg_work and seg_sync (same device type), so those are
            evaluated once per label. Memory is still asked per stage.
        block_names: per block, a name for messages (e.g. its split point).
    """

    n_blocks: int
    n_stages: int
    micro_batches: int
    seg_work: SegFn
    seg_memory: SegFn
    capacity: Sequence[float]
    cut_time: CutFn = _zero_cut
    seg_sync: SegFn = _zero_seg
    allowed_starts: frozenset[int] | None = None
    stage_class: Sequence[int] | None = None
    block_names: Sequence[str] | None = None

    def __post_init__(self) -> None:
        for name in ("n_blocks", "n_stages", "micro_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer ≥ 1 (got {value!r})")
        for name in ("seg_work", "seg_memory", "cut_time", "seg_sync"):
            if not callable(getattr(self, name)):
                raise ValueError(f"{name} must be callable (got {getattr(self, name)!r})")
        if len(self.capacity) != self.n_stages:
            raise ValueError(
                f"capacity has {len(self.capacity)} entries for {self.n_stages} stages: "
                "give one per stage"
            )
        for s, cap in enumerate(self.capacity):
            if not cap > 0:  # also rejects NaN
                raise ValueError(f"capacity[{s}] must be > 0 bytes (got {cap!r})")
        if self.allowed_starts is not None:
            bad = sorted(j for j in self.allowed_starts if not 0 <= j < self.n_blocks)
            if bad:
                raise ValueError(
                    f"allowed_starts must lie in 0..{self.n_blocks - 1} (got {bad[:5]})"
                )
        if self.stage_class is not None and len(self.stage_class) != self.n_stages:
            raise ValueError(
                f"stage_class has {len(self.stage_class)} entries for {self.n_stages} "
                "stages: give one label per stage"
            )
        if self.block_names is not None and len(self.block_names) != self.n_blocks:
            raise ValueError(
                f"block_names has {len(self.block_names)} entries for {self.n_blocks} blocks"
            )

    def block_label(self, i: int, j: int | None = None) -> str:
        """'block 3 ('layers.2')' or 'blocks 3..5', for messages."""
        return block_label(self.block_names, i, j)


def block_label(names: Sequence[str] | None, i: int, j: int | None = None) -> str:
    """'block 3 ('layers.2')' or 'blocks 3..5 ('a'..'c')' (``names``: per block, or None)."""
    if j is None or j == i + 1:
        return f"block {i}" + (f" ({names[i]!r})" if names else "")
    return f"blocks {i}..{j - 1}" + (f" ({names[i]!r}..{names[j - 1]!r})" if names else "")


@dataclass(frozen=True, kw_only=True)
class PartitionSolution:
    """A placement and how sure we are of it.

    Attributes:
        starts: first block of each stage; ``starts[0] == 0``.
        objective: its step time T (units of the cost callables).
        stage_work, cut_times, stage_sync, stage_memory: per stage (cut_times
            per link, S − 1 of them) values of the placement.
        status: "optimal": proven within a relative gap of 1e-7 (by the
            solver, or by our bounds alone); "time_limit": the limit stopped
            the search first (before or during the ILP), this is the best
            placement found; "heuristic": the solver ended for another reason
            without a better placement, this is the incumbent (see
            solver_status).
        gap: (objective − bound) / objective; ≤ 1e-7 when optimal.
        bound: the best proven lower bound on T: the solver's dual bound
            (HiGHS's mip_dual_bound, CBC's "Lower bound" line) or our root
            bound, whichever is higher.
        solver: "highs" or "cbc".
        solve_s: wall seconds of the whole call.
        solver_s: of those, the seconds inside the MILP solver (0 when it did
            not run).
        n_segments: binaries in the ILP after pruning.
        solver_status: the solver's own words, for the record.
    """

    starts: tuple[int, ...]
    objective: float
    stage_work: tuple[float, ...]
    cut_times: tuple[float, ...]
    stage_sync: tuple[float, ...]
    stage_memory: tuple[float, ...]
    status: Status
    gap: float | None
    bound: float | None
    solver: str
    solve_s: float
    solver_s: float = 0.0
    n_segments: int
    solver_status: str = ""


def placement_indices(pos: Sequence[int], n_stages: int, starts: Sequence[int]) -> list[int]:
    """A placement's ``starts`` as indices into ``pos`` (the allowed split positions,
    ``pos[-1]`` the end), with the end's index appended; ValueError if malformed."""
    where = {p: a for a, p in enumerate(pos[:-1])}
    starts = list(starts)
    if len(starts) != n_stages or not starts or starts[0] != 0:
        raise ValueError(f"starts must have {n_stages} entries beginning with 0 (got {starts})")
    if any(x >= y for x, y in itertools.pairwise(starts)):
        raise ValueError(f"starts must increase strictly (got {starts})")
    bad = [j for j in starts if j not in where]
    if bad:
        raise ValueError(f"starts {bad} are not allowed split points (or ≥ n_blocks)")
    return [where[j] for j in starts] + [len(pos) - 1]


def format_bytes(x: float) -> str:
    """A size with its binary unit, one decimal: "1.5 GiB", "12.0 MiB", "512 B"."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= size:
            return f"{x / size:.1f} {unit}"
    return f"{x:.0f} B"


# ---------------------------------------------------------------- why nothing fits
# The words of both solvers (the closed form's and the step's) when no placement fits.

_FIX_STAGES = (
    "use more stages or larger devices, recompute activations, or fewer samples per micro-batch"
)


def unfit_block(what: str, room: float, need: float, stage: int, capacity: float) -> str:
    """One run between legal split points fits no stage that could hold it."""
    return (
        f"no stage can hold {what} within {format_bytes(room)}: it needs {format_bytes(need)} "
        f"on stage {stage} (capacity {format_bytes(capacity)}).\n  fix: recompute "
        "activations, use fewer samples per micro-batch, split the block, or give the stage "
        "a device with more memory"
    )


def unfit_whole(what: str, need: float, capacity: float) -> str:
    """One stage cannot hold the whole chain."""
    return (
        f"the blocks do not fit in the memory of one stage: {what} need {format_bytes(need)} "
        f"against {format_bytes(capacity)}.\n  fix: {_FIX_STAGES}"
    )


def unfit_last(n_stages: int, left: str, need: float, capacity: float) -> str:
    """The stages before the last, filled as far as memory allows, leave it too much."""
    return (
        f"the blocks do not fit in the memory of {n_stages} stages: filling stages "
        f"0..{n_stages - 2} as far as memory allows leaves {left} for stage {n_stages - 1}, "
        f"needing {format_bytes(need)} against {format_bytes(capacity)}.\n  fix: {_FIX_STAGES}"
    )


def unfit_stage(n_stages: int, stage: int, capacity: float, need: float) -> str:
    """A stage cannot hold any run starting where the stages before it can end."""
    return (
        f"the blocks do not fit in the memory of {n_stages} stages: stage {stage} "
        f"({format_bytes(capacity)}) cannot hold any run of blocks where stages "
        f"0..{stage - 1} can end (the smallest needs {format_bytes(need)}).\n  fix: use larger "
        "devices for it, recompute activations, or fewer samples per micro-batch"
    )
