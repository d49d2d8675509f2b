"""Tied parameters across stages: one tensor in the model, a copy in each stage that uses it.

See the note below for why, and how.
"""

# [Note: why tied grads are all-reduced]
#
# A tied weight is one tensor used in two places, e.g. GPT's token embedding
# (stage 0) and its LM head (the last stage): the head's ``weight`` *is*
# ``tok_emb.weight``. In one process its gradient is the sum of both uses'
# contributions, g = g_emb + g_head, and one optimizer update keeps it one
# tensor. ``pipeline()`` puts a separate copy in every stage that reads it
# (``Pipe.__init__`` deep-copies each entry of ``replicated_params``; stage 0
# holds it as ``tok_emb.weight``, the last stage as ``head.weight``) and never
# syncs them: each copy would see only its own stage's contribution, the copies
# would drift apart after the first step, and neither would be the model's
# weight. So after backward (and after DDP has averaged each copy over the
# replicas) and before the optimizer step, the copies' gradients are summed
# (all-reduce SUM) among the ranks of one replica that hold a copy. Every copy
# then has g_emb + g_head, the gradient of the unsplit model; starting from
# equal values (broadcast once at start-up), with equal gradients and the same
# optimizer, the copies stay bit-identical step after step. One process group
# per tied set per replica (replicas are already averaged by DDP).
#
# A stage may hold several copies of one set: T5 ties ``shared``, the encoder's
# and the decoder's embeddings and the LM head, and ``pipeline()`` gives a stage
# that reads two of them two tensors. Then each rank first sums its own copies'
# gradients, the sum is all-reduced over the holding stages (when several
# hold), and every copy gets the total: the same rule, any number of copies
# per stage and across stages. With several stages per rank (v > 1) a rank's
# copies are those of all its stages, and the group has each holding rank once.

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from planner.plan.schema import Plan
from runtime.fsdp import like, local
from runtime.mesh import Mesh
from runtime.stage import StageModule

__all__ = ["TiedGroup", "TiedParams", "build_tied", "tied_sets"]

log = logging.getLogger(__name__)


def tied_sets(plan: Plan, model: nn.Module) -> list[tuple[str, ...]]:
    """Every set of parameter names that are one tensor in ``model``, in model order.

    Example::

        >>> tied_sets(plan, gpt)  # doctest: +SKIP
        [('tok_emb.weight', 'head.weight')]

    The model (identity of its tensors) is the truth; the plan's profile
    (``plan.profiles[0].tied``) is checked against it, and a set the plan lists
    that the model does not tie is logged and ignored.
    """
    by_tensor: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(name)
    sets = [tuple(names) for names in by_tensor.values() if len(names) > 1]
    planned = plan.profiles[0].tied if plan.profiles else ()
    for ts in planned:
        if not any(set(ts.names) <= set(s) for s in sets):
            log.warning(
                "the plan lists %s as tied, but they are not one tensor in this model; "
                "treating them as separate parameters",
                list(ts.names),
            )
    return sets


@dataclass(frozen=True, eq=False)
class TiedGroup:
    """One tied set in this rank's replica.

    Attributes:
        names: every FQN of the tensor.
        stages: the stages holding a copy (the same in every replica).
        ranks: this replica's ranks holding a copy, in stage order, each once
            (with v > 1 one rank may run several holding stages).
        params: this rank's copies (several when its stages hold several;
            empty when it holds none).
        group: the process group of ``ranks`` (None when this rank is not in
            it, or when one stage holds all the copies).
    """

    names: tuple[str, ...]
    stages: tuple[int, ...]
    ranks: tuple[int, ...]
    params: tuple[nn.Parameter, ...]
    group: dist.ProcessGroup | None


class TiedParams:
    """The tied sets held by several stages, and the all-reduce that keeps their copies equal."""

    def __init__(self, groups: Sequence[TiedGroup]) -> None:
        self.groups = tuple(groups)

    @property
    def mine(self) -> tuple[TiedGroup, ...]:
        """The groups this rank holds a copy in."""
        return tuple(g for g in self.groups if g.params)

    def broadcast_weights(self) -> None:
        """Make every copy equal to the first stage's first (once, at start-up)."""
        for g in self.mine:
            first, *others = g.params
            with torch.no_grad():  # FSDP: every copy's shard is the same part (one replica)
                if g.group is not None:
                    dist.broadcast(local(first.data), src=g.ranks[0], group=g.group)
                for p in others:
                    local(p.data).copy_(local(first.data))

    def sync_grads(self) -> None:
        """Sum the copies' gradients (see the module's note); call after backward, before step."""
        pending = []
        for g in self.mine:
            # A copy whose use did not reach the loss contributes zeros.
            grads = [
                local(p.grad) if p.grad is not None else torch.zeros_like(local(p))
                for p in g.params
            ]
            total = grads[0] if len(grads) == 1 else torch.stack(grads).sum(0)
            work = None
            if g.group is not None:
                work = dist.all_reduce(total, op=dist.ReduceOp.SUM, group=g.group, async_op=True)
            pending.append((g, total, work))
        for g, total, work in pending:
            if work is not None:
                work.wait()
            for k, p in enumerate(g.params):
                p.grad = like(p, total if k == 0 else total.clone())


def build_tied(
    sets: Sequence[tuple[str, ...]], stages: Sequence[StageModule], mesh: Mesh
) -> TiedParams:
    """The process groups of the tied sets that several stages hold, and equal start values.

    Example::

        tied = build_tied(tied_sets(plan, model), stages, mesh)
        ...; schedule.step(...); tied.sync_grads(); optimizer.step()

    ``stages`` are this rank's (several when v > 1). Which stages hold a copy is
    read from ``stages[0].held`` (every stage's kept names, the same on every
    rank), so every rank creates the same groups in the same order, as
    ``dist.new_group`` requires. A set whose holders all run on one rank (one
    stage keeping it as one tensor, or several copies on this rank's stages)
    sums its copies locally (no group), or has nothing to sync.
    """
    groups: list[TiedGroup] = []
    held = stages[0].held
    for names in sets:
        holders = tuple(s for s, kept in enumerate(held) if kept & set(names))
        copies = _local_copies([st.module for st in stages if st.index in holders], names)
        # One rank per pipeline position: several holding stages may share one.
        positions = tuple(dict.fromkeys(mesh.stage_ranks[s] for s in holders))
        if len(positions) == 1 and len(copies) < 2:
            continue
        for r in range(mesh.dp):
            ranks = tuple(mesh.grid[r][k] for k in positions)
            pg = dist.new_group(sorted(ranks)) if len(positions) > 1 else None
            if r == mesh.replica:
                mine = mesh.rank in ranks
                groups.append(
                    TiedGroup(
                        names=tuple(names),
                        stages=holders,
                        ranks=ranks,
                        params=copies if mine else (),
                        group=pg if mine else None,
                    )
                )
        log.info(
            "%s tied %s: copies on stages %s (%d here), gradients summed",
            mesh.prefix,
            list(names),
            list(holders),
            len(copies),
        )
    tied = TiedParams(groups)
    tied.broadcast_weights()
    return tied


def _local_copies(modules: Sequence[nn.Module], names: tuple[str, ...]) -> tuple[nn.Parameter, ...]:
    """These stages' distinct tensors for the tied set ``names`` (none, one or more)."""
    found = {
        id(p): p
        for module in modules
        for n, p in module.named_parameters(remove_duplicate=False)
        if n in names
    }
    return tuple(found.values())
