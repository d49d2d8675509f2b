"""pp = 1: plain DDP with gradient accumulation over the micro-batches, no pipelining schedule.

A plan with one stage needs no split and no schedule: the model itself (DDP
over the replicas when dp > 1) runs the plan's m micro-batches one after the
other, forward then backward, the first m − 1 under ``no_sync()``, so the
gradients accumulate locally and are all-reduced once, during the last
backward, as a hand-written DDP training loop does (with ``dp_mode: fsdp``:
no gradient sync and no resharding until the last backward, as torch's
pipeline stage does, ``runtime.fsdp``). The loss of micro-batch i
is scaled by 1/m before its backward: the same gradient as the pipelining
schedule's ``scale_grads`` ([Note: one loss-normalisation rule] in
``runtime.engine``).

:class:`Accumulate` speaks the schedule's ``step(*args, target=, losses=,
**kwargs)`` and the stage's ``forward_one_chunk`` / ``backward_one_chunk``
(one micro-batch each; the recorder times them as it times torch's stage), and
keeps the loss in ``_loss_fn``, as torch's schedules do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from planner.plan.batch import batch_size_of, slice_batch
from planner.plan.schema import Plan
from runtime.fsdp import is_sharded, set_last_backward
from runtime.mesh import Mesh
from runtime.recompute import maybe_recompute
from runtime.stage import StageModule, replicate

__all__ = ["Accumulate", "build_whole"]


def build_whole(model: nn.Module, plan: Plan, mesh: Mesh) -> StageModule:
    """The one stage of a pp = 1 plan: the model itself (DDP-wrapped when dp > 1, or with
    ``dp_mode: fsdp`` one FSDP unit)."""
    assert plan.pp == 1, plan.pp
    names = frozenset(k for k, _ in model.named_parameters(remove_duplicate=False)) | frozenset(
        k for k, _ in model.named_buffers(remove_duplicate=False)
    )
    runner = maybe_recompute(model, plan.stages[0].recompute)
    wrapped = replicate(runner, mesh, plan)
    stage = StageModule(
        index=0,
        num_stages=1,
        module=model,
        wrapped=wrapped,
        pipeline_stage=None,
        method="whole",
        fallback_reason=None,
        held=(names,),
        restore=lambda out: out,
    )
    return stage


class Accumulate:
    """The micro-batches of one replica, forward and backward in turn (module docstring)."""

    def __init__(
        self, stage: StageModule, n_microbatches: int, loss_fn: Callable[[Any, Any], Tensor]
    ) -> None:
        self.stage = stage
        self.m = n_microbatches
        self._loss_fn = loss_fn
        stage.pipeline_stage = self

    def step(
        self,
        *args: Any,
        target: Any = None,
        losses: list[Tensor] | None = None,
        return_outputs: bool = False,
        **kwargs: Any,
    ) -> None:
        size = batch_size_of(args, kwargs)
        if size % self.m:
            raise ValueError(
                f"the replica's batch of {size} samples does not split into {self.m} "
                "equal micro-batches"
            )
        b = size // self.m
        for k in range(self.m):
            lo, hi = k * b, (k + 1) * b
            mb_args, mb_kwargs, mb_target = slice_batch((args, kwargs, target), lo, hi, size)
            with self._sync(k):
                out = self.forward_one_chunk(k, mb_args, mb_kwargs)
                loss = self._loss_fn(out, mb_target)
                _check_loss(loss)
                self.backward_one_chunk(k, loss)
            if losses is not None:
                losses.append(loss.detach())

    def forward_one_chunk(self, k: int, args: Any, kwargs: Any) -> Any:
        """Micro-batch k's forward: what the model returns."""
        return self.stage.wrapped(*args, **kwargs)

    def backward_one_chunk(self, k: int, loss: Tensor) -> None:
        """Micro-batch k's backward, its loss scaled by 1/m."""
        (loss / self.m).backward()

    def _sync(self, k: int) -> Any:
        wrapped = self.stage.wrapped
        if is_sharded(wrapped):  # as torch's stage: sync and free after the last backward only
            set_last_backward(wrapped, k == self.m - 1)
            return contextlib.nullcontext()
        if isinstance(wrapped, DistributedDataParallel) and k < self.m - 1:
            return wrapped.no_sync()
        return contextlib.nullcontext()


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, Tensor) else ""
        raise ValueError(
            "loss_fn must return one scalar tensor (the micro-batch's mean), got "
            f"{type(loss).__name__}{shape}"
        )
