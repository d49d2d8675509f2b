"""FSDP2: a stage's replicas each hold a shard of its parameters, gradients and optimizer state.

With ``layout.dp_mode: fsdp`` every stage module (each of a rank's v stages;
with pp = 1 the model itself) is one unit of torch's ``fully_shard`` over the
stage's replicas, with ``reshard_after_forward=False``. [Note: FSDP in a
pipeline stage] What then happens in a step, as the planner prices it
(``planner.cost``, [Note: FSDP as it runs]):

* between steps each replica holds 1/dp of every parameter tensor (a dim-0
  shard, a ``DTensor``), the optimizer state of that shard, and its gradient;
* the stage's first forward of the step all-gathers its parameters; they stay
  whole until the stage's last backward of the step;
* gradients accumulate whole over the micro-batches (torch's stage turns the
  sync off for all but the last backward, ``stage.backward_maybe_with_nosync``;
  ``runtime.accumulate`` does the same at pp = 1); the last backward ends with
  one reduce-scatter (the mean over the replicas; in bf16 under bf16-mixed, as
  DDP's compressed all-reduce), then the whole parameters and gradients are
  freed;
* the optimizer steps the shard: no weights to exchange after it.

Gradients are DTensors: the global norm, clipping and the tied copies' sums
work on each rank's local shard (:func:`local`), the norm summed over the dp
group as well (``runtime.gradients``). Reading the weights whole
(``ParallelModel.state_dict``) gathers them: a collective over each stage's
replicas.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from planner.plan.schema import Plan
from runtime.mesh import Mesh

__all__ = ["is_sharded", "like", "local", "set_last_backward", "shard_stage", "whole"]


def shard_stage(module: nn.Module, mesh: Mesh, plan: Plan) -> nn.Module:
    """``fully_shard`` the stage over its replicas (module docstring); the same object.

    A stage without trainable parameters is left as it is (nothing to shard).
    """
    if not any(p.requires_grad for p in module.parameters()):
        return module
    dp_mesh = DeviceMesh.from_group(mesh.dp_group, mesh.device.type)
    reduce = torch.bfloat16 if plan.precision == "bf16-mixed" else None
    fully_shard(
        module,
        mesh=dp_mesh,
        reshard_after_forward=False,
        mp_policy=MixedPrecisionPolicy(reduce_dtype=reduce),
    )
    return module


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP unit (:func:`shard_stage` wrapped it)."""
    return isinstance(module, FSDPModule)


def set_last_backward(module: nn.Module, last: bool) -> None:
    """Before a micro-batch's backward at pp = 1: reduce-scatter and free only after the last.

    What torch's pipeline stage does for its FSDP stages
    (``backward_maybe_with_nosync``): no gradient sync and no resharding until
    the step's last backward.
    """
    assert isinstance(module, FSDPModule)
    module.set_is_last_backward(last)
    module.set_reshard_after_backward(last)
    module.set_requires_gradient_sync(last)


def local(t: Tensor) -> Tensor:
    """This rank's part of ``t``: a DTensor's local shard (shares its storage), else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def whole(t: Tensor) -> Tensor:
    """``t`` whole: a DTensor gathered (a collective over its mesh), else ``t`` itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def like(param: Tensor, value: Tensor) -> Any:
    """``value`` (a local shard) as a tensor of ``param``'s kind: a DTensor on its mesh."""
    if isinstance(param, DTensor):
        return DTensor.from_local(
            value, param.device_mesh, param.placements, run_check=False,
            shape=param.shape, stride=param.stride(),
        )  # fmt: skip
    return value
