"""A layout's cost model as the partition solver's problem: numbers in, no torch, no planner.

The solver (:mod:`planner.solve`) knows nothing of the planner; this is where
the cost model's segment figures become its callables.
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.cost.model import CostModel
from planner.solve.problem import PartitionProblem

__all__ = ["partition_problem"]


def partition_problem(
    cost: CostModel, allowed_starts: frozenset[int] | None = None, names: Sequence[str] = ()
) -> PartitionProblem:
    """The :class:`PartitionProblem` of ``cost``'s layout (the closed-form objective).

    Example::

        sol = solve_partition(partition_problem(cost, names=block_names))

    A stage that does not fit without recompute is costed with it
    (:meth:`CostModel.stage_work`), so the problem needs no recompute variable.
    Stages with the same device types, nodes and replica layout cost the same
    (``stage_class``), which the solver uses to price each segment once.
    """
    return PartitionProblem(
        n_blocks=cost.n_blocks,
        n_stages=cost.layout.pp,
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
