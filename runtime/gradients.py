"""The step's gradients across stages and replicas: their global norm, clipping, and finiteness.

[Note: the global gradient norm]
One process's ``clip_grad_norm_(model.parameters(), c)`` takes the 2-norm of
every parameter's gradient, each tensor once. Here the parameters are spread
over the pipeline's stages, and each replica holds the same gradients after
DDP's all-reduce, so the norm is

    ‖g‖ = sqrt( Σ_stages Σ_{p on the stage} ‖g_p‖² )

summed over one replica's stages (an all-reduce over the pp group), where a
tied tensor (copies on several stages, or several copies on one, all holding
the same summed gradient after ``TiedParams.sync_grads``) counts once: on the
first stage holding it, its first copy. Every rank gets the same norm, so every
rank takes the same decision (clip, skip, stop) without another collective.
Clipping then scales every gradient (every copy) by ``c / (‖g‖ + 1e-6)`` when
that is below 1, as torch's ``clip_grad_norm_`` does. With FSDP each replica
holds a shard of every gradient (``runtime.fsdp``): the sum of squares is taken
over the local shards and summed over the dp group too.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from runtime.fsdp import local
from runtime.mesh import Mesh
from runtime.options import NONFINITE_ACTIONS
from runtime.stage import StageModule
from runtime.tied import TiedParams

__all__ = ["NONFINITE_ACTIONS", "GradientNorm", "GradientStep", "NonFiniteError"]

log = logging.getLogger(__name__)


class NonFiniteError(ArithmeticError):
    """The loss or the gradients of a step are NaN or infinite."""


class GradientNorm:
    """The global gradient norm of one replica's stages (see the note above); ``modules``
    are this rank's stages' (several when v > 1)."""

    def __init__(
        self, modules: Sequence[nn.Module], tied: TiedParams, mesh: Mesh, sharded: bool = False
    ) -> None:
        self.mesh = mesh
        self.sharded = sharded  # FSDP: each replica holds a shard of every gradient
        skip: set[int] = set()
        for g in tied.mine:
            owner = g.ranks[0] == mesh.rank
            skip |= {id(p) for k, p in enumerate(g.params) if not (owner and k == 0)}
        seen: set[int] = set()
        self.counted: list[nn.Parameter] = []
        self.every: list[nn.Parameter] = []
        for p in (p for module in modules for p in module.parameters()):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            self.every.append(p)
            if id(p) not in skip:
                self.counted.append(p)

    def norm(self) -> float:
        """‖g‖ over the replica's stages (a collective over the pp group when pp > 1)."""
        grads = [local(p.grad) for p in self.counted if p.grad is not None]
        device = self.mesh.device
        if grads:
            norms = torch._foreach_norm([g.detach() for g in grads], 2.0)
            total = torch.stack([n.float() for n in norms]).square().sum().reshape(1)
        else:
            total = torch.zeros(1, device=device)
        if self.mesh.pp > 1:
            dist.all_reduce(total, group=self.mesh.pp_group)
        if self.sharded:  # the replicas' shards together make the gradients
            dist.all_reduce(total, group=self.mesh.dp_group)
        return math.sqrt(float(total.item()))

    def clip(self, norm: float, max_norm: float) -> float:
        """Scale every gradient so the global norm is at most ``max_norm``; the factor used."""
        coef = max_norm / (norm + 1e-6)
        if coef >= 1.0:
            return 1.0
        grads: list[Tensor] = [local(p.grad) for p in self.every if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coef)
        return coef

    def zero(self) -> None:
        """Drop this step's gradients (a skipped step)."""
        for p in self.every:
            p.grad = None


class GradientStep:
    """What follows a step's backward: checks, clipping, and the optimizer's step.

    Example::

        update = GradientStep(stages, tied, mesh, optimizer, clip_grad_norm=1.0)
        ...; schedule.step(...); tied.sync_grads()
        update(loss)           # raises NonFiniteError, or skips, or clips and steps

    Attributes:
        norm: the last step's global gradient norm, before clipping.
        skipped: whether the last step's update was skipped (non-finite).

    Raises:
        ValueError: ``clip_grad_norm`` ≤ 0, or ``on_nonfinite`` not one of
            :data:`NONFINITE_ACTIONS`.
    """

    def __init__(
        self,
        stages: Sequence[StageModule],
        tied: TiedParams,
        mesh: Mesh,
        optimizer: Optimizer | None,
        *,
        clip_grad_norm: float | None = None,
        on_nonfinite: str = "stop",
        after_step: Callable[[], None] | None = None,
    ) -> None:
        check_gradient_options(clip_grad_norm, on_nonfinite)
        self.stages, self.mesh, self.optimizer = tuple(stages), mesh, optimizer
        self.after_step = after_step  # ZeRO-1: the weights' exchange (runtime.zero)
        self.clip_grad_norm, self.on_nonfinite = clip_grad_norm, on_nonfinite
        sharded = any(st.fsdp for st in self.stages)
        self.grads = GradientNorm([st.module for st in self.stages], tied, mesh, sharded)
        self.norm = float("nan")
        self.skipped = False
        self._checked = False

    def __call__(self, loss: float) -> None:
        """Check the loss and the global gradient norm, clip, and step the optimizer."""
        if not self._checked:
            self._check_missing()
        norm = self.norm = self.grads.norm()
        self.skipped = not (math.isfinite(loss) and math.isfinite(norm))
        if self.skipped:
            what = f"the loss is {loss}" if not math.isfinite(loss) else "the loss is finite"
            what += f" and the global gradient norm is {norm}"
            if self.on_nonfinite == "stop":
                raise NonFiniteError(
                    f"{what}: training stopped before this step's update, so the weights "
                    "and every checkpoint stay finite.\n  fix: lower the learning rate, "
                    "clip gradients (--clip-grad-norm), check the data and the loss for "
                    "NaN/inf, or skip such steps (--on-nonfinite skip)"
                )
            log.warning("%s %s: this step's update is skipped", self.mesh.prefix, what)
            self.grads.zero()
            return
        if self.clip_grad_norm is not None:
            self.grads.clip(norm, self.clip_grad_norm)
        if self.optimizer is not None:
            self.optimizer.step()
        if self.after_step is not None:  # on every rank, with or without a share
            self.after_step()

    def _check_missing(self) -> None:
        """After the first backward: a trainable parameter without a gradient breaks DDP."""
        self._checked = True
        for st in self.stages:
            missing = [
                n for n, p in st.module.named_parameters() if p.requires_grad and p.grad is None
            ]
            if not missing:
                continue
            msg = (
                f"{self.mesh.prefix} {len(missing)} trainable parameter(s) of stage "
                f"{st.index} got no gradient: {missing[:5]}; they are read but do not "
                "reach the loss. fix: freeze them (p.requires_grad_(False)) or remove them"
            )
            if st.ddp:
                raise ValueError(msg + " (DDP needs a gradient for every trainable parameter)")
            log.warning("%s", msg)


def check_gradient_options(clip_grad_norm: float | None, on_nonfinite: str) -> None:
    """Raise ``ValueError`` for a clipping norm ≤ 0 or an unknown non-finite action."""
    if clip_grad_norm is not None and not clip_grad_norm > 0:
        raise ValueError(f"clip_grad_norm must be > 0 (or None: no clipping), got {clip_grad_norm}")
    if on_nonfinite not in NONFINITE_ACTIONS:
        raise ValueError(
            f"on_nonfinite must be one of {', '.join(NONFINITE_ACTIONS)}, got {on_nonfinite!r}"
        )
