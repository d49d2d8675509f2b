"""What the zero-bubble schedules need of a stage: outputs torch may detach in place, no
warm-up messages to its own rank, and its replicas' gradients averaged without DDP.

[Note: a split backward keeps the stage's graph]
torch's zero-bubble schedules (Interleaved ZB, ZB-V, DualPipeV) split each
backward into the input's part (``I``) and the weights' part (``W``, later).
After ``I``, torch's ``stage_backward_input`` detaches the stage's outputs in
place (``t.detach_()``) to free the graph above them. When an output is also
saved by an op inside the stage, that breaks ``W``: a GPT stage that ends
between a block's residual add and its LayerNorm sends the residual on and
feeds it to the LayerNorm, which saved it, and ``W`` then fails with "Trying to
use a saved tensor that has been detached in-place" (torch 2.13, tried).

:class:`Detachable` gives torch an alias of each output to detach instead: a
new tensor over the same storage (``detach()``: no copy, one version counter)
whose only autograd node passes the gradient through. Detaching the alias
drops that node alone; everything the stage saved stays until ``W`` frees it,
which is what the planner prices (activations held until ``W``,
``planner.plan.schedule.held_at_peak``).

[Note: the V schedules' neighbours on one rank]
ZB-V and DualPipeV place two consecutive stages on one rank (stages pp − 1 and
pp on the last rank). torch passes their tensors locally in the step, but its
first-step warm-up of the traced stages (``_get_init_p2p_neighbors_ops``) still
posts a send and a receive to the rank itself, which gloo refuses ("Pair is not
connected", torch 2.13, tried). :func:`skip_self_warmup` drops those two
messages from the warm-up; the other neighbours' stay.

[Note: DDP under a split backward]
DDP reduces a parameter's gradient when autograd produces it inside a
backward it was told to expect. A split backward's ``W`` runs outside it, so
DDP never reduces the weights' gradients (pytorch#144530), and a reducer left
waiting for them fails the next step. With DDP or ZeRO-1 and more than one
replica (:func:`reduces_by_hand`) a stage is therefore not DDP-wrapped:
:func:`reduce_by_hand` makes torch's stage average its gradients over its
replicas right after its last ``W`` of the step (its last full backward, for
a schedule that ends without one), in one flat all-reduce per dtype. That is
where, and how big, the simulator prices DDP's all-reduce (after the stage's
last backward, off the gradients' way back) and the memory model its buckets
(one flat copy the size of the gradients). Under ``bf16-mixed`` the copy
crosses the wire in bf16, as DDP's hook sends it
(``runtime.precision.mean_all_reduce``); that bf16 copy, half the size and
alive for the all-reduce alone, is not priced (DDP's is one bucket). FSDP needs
nothing: torch's ``REDUCE_GRAD`` action reduce-scatters.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from planner.plan.schedule import SPLIT_BACKWARD
from planner.plan.schema import Plan
from runtime.mesh import Mesh
from runtime.precision import mean_all_reduce
from runtime.wrapper import StageWrapper

__all__ = ["Detachable", "detachable", "reduce_by_hand", "reduces_by_hand", "skip_self_warmup"]


class _Alias(torch.autograd.Function):
    """The identity, as a tensor of its own (same storage) with a node of its own."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad


class Detachable(StageWrapper):
    """``module`` whose outputs that need a gradient come out as aliases torch may
    detach in place ([Note: a split backward keeps the stage's graph])."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.module(*args, **kwargs)
        leaves, spec = pytree.tree_flatten(out)
        aliased = [
            _Alias.apply(t) if isinstance(t, Tensor) and t.requires_grad else t for t in leaves
        ]
        return pytree.tree_unflatten(aliased, spec)


def detachable(module: nn.Module, schedule: str) -> nn.Module:
    """``Detachable(module)`` under a schedule of split backwards, else ``module``."""
    return Detachable(module) if schedule in SPLIT_BACKWARD else module


def skip_self_warmup(stage: Any) -> None:
    """Drop the warm-up messages torch's traced ``stage`` would post to its own rank
    ([Note: the V schedules' neighbours on one rank])."""
    warmup = getattr(stage, "_get_init_p2p_neighbors_ops", None)
    if warmup is None:
        return
    me = dist.get_rank(stage.group)

    def without_self() -> list[dist.P2POp]:
        return [op for op in warmup() if op.group_peer != me]

    stage._get_init_p2p_neighbors_ops = without_self


def reduces_by_hand(plan: Plan, dp: int) -> bool:
    """Whether this plan's replicas average their gradients by hand, not with DDP
    ([Note: DDP under a split backward])."""
    return plan.schedule in SPLIT_BACKWARD and plan.dp_mode != "fsdp" and dp > 1


def reduce_by_hand(stage: Any, module: nn.Module, mesh: Mesh, plan: Plan) -> None:
    """Where the plan's replicas average their gradients by hand (:func:`reduces_by_hand`),
    make torch's ``stage`` average ``module``'s over ``mesh``'s dp group after its last
    backward of each step ([Note: DDP under a split backward])."""
    if not reduces_by_hand(plan, mesh.dp):
        return
    weight_pass, full_pass = stage.backward_weight_one_chunk, stage.backward_one_chunk

    def average() -> None:
        grads = [p.grad for p in module.parameters() if p.requires_grad and p.grad is not None]
        for dtype in dict.fromkeys(g.dtype for g in grads):
            same = [g for g in grads if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in same])
            mean_all_reduce(flat, mesh.dp_group, plan)  # bf16 on the wire under bf16-mixed
            for g, part in zip(same, flat.split([g.numel() for g in same]), strict=True):
                g.copy_(part.view_as(g))

    def weights(bwd_chunk_id: int, last_backward: bool = False) -> None:
        weight_pass(bwd_chunk_id, last_backward=last_backward)
        if last_backward:
            average()

    def full(bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
             last_backward: bool = False) -> None:  # fmt: skip
        full_pass(bwd_chunk_id, loss=loss, full_backward=full_backward,
                  last_backward=last_backward)  # fmt: skip
        if last_backward and full_backward:
            average()

    stage.backward_weight_one_chunk = weights
    stage.backward_one_chunk = full
