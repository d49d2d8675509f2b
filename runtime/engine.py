"""``ParallelModel``: a plan running — pipeline stages × DDP replicas, one ``step`` per batch.

The gradient scale follows one rule, stated in the note below.
"""

# [Note: one loss-normalisation rule]
#
# The loss function returns the MEAN over its micro-batch (as F.cross_entropy
# and F.mse_loss do by default). Then, with B the global batch, dp replicas and
# m micro-batches of b = B / (dp·m) samples:
#
#   micro-batch   loss_i = (1/b) Σ_{x ∈ mb i} ℓ(x)     (the user's loss)
#   schedule      g_r = (1/m) Σ_i ∇loss_i               (scale_grads=True: ÷ m once per step)
#   DDP           g = (1/dp) Σ_r g_r                     (DDP averages over the dp group)
#               ⇒ g = (1/B) Σ_{x ∈ batch} ∇ℓ(x)
#
# which is the gradient one process computes on the whole global batch with a
# mean loss. Tied copies then sum their stages' contributions (see [Note: why
# tied grads are all-reduced] in runtime/tied.py). The returned loss follows
# the same rule: the last stage's mean of its m micro-batch losses, broadcast
# over the pipeline and averaged over the replicas. A loss that *sums* over
# samples would be scaled by 1/(m·dp) relative to one process: use means.

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from planner.plan.batch import batch_size_of, normalize_inputs, slice_batch
from planner.plan.schema import Plan
from runtime.accumulate import build_whole
from runtime.checks import check_plan
from runtime.fsdp import whole
from runtime.gradients import GradientStep, check_gradient_options
from runtime.materialize import stage_weights
from runtime.mesh import Mesh, init_mesh
from runtime.options import DEFAULT_TIMEOUT_S
from runtime.precision import autocast, check_training, compress_gradients
from runtime.schedule import check_schedule, make_schedule
from runtime.stage import StageModule, build_stages
from runtime.tied import TiedParams, build_tied, tied_sets
from runtime.zero import stepped_params

__all__ = ["ParallelModel"]

log = logging.getLogger(__name__)

LossFn = Callable[[Any, Any], Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], Optimizer]


class ParallelModel:
    """A model trained as a plan says: build with :meth:`from_plan`, train with :meth:`step`.

    Every rank runs the same code; each holds one stage of one replica, or
    ``plan.virtual`` of them (Interleaved 1F1B, Looped BFS).

    Attributes:
        plan, mesh: what runs where.
        stages: this rank's stages, in model order (one when v = 1).
        stage: the first of them (the only one when v = 1).
        optimizer: over this rank's trainable parameters (None when it has none); with
            ``layout.dp_mode: zero1``, over this replica's share of them (``runtime.zero``).
        tied: the tied-parameter groups.
        update: what follows the backward (``runtime.gradients.GradientStep``):
            its ``norm`` (the last global gradient norm) and ``skipped``.
        last_step_s: wall time of the last ``step`` on this rank (seconds).
        step_times: wall time of every ``step`` so far on this rank.
    """

    def __init__(
        self,
        *,
        plan: Plan,
        mesh: Mesh,
        stages: Sequence[StageModule],
        tied: TiedParams,
        schedule: Any,
        optimizer: Optimizer | None,
        canonical: Mapping[str, str],
        unplaced: Mapping[str, Tensor],
        update: GradientStep,
    ) -> None:
        self.plan = plan
        self.mesh = mesh
        self.stages = tuple(stages)
        self.stage = self.stages[0]
        self.tied = tied
        self.schedule = schedule
        self.optimizer = optimizer
        self._canonical = dict(canonical)
        self._order = list(dict.fromkeys(canonical.values()))
        self._unplaced = dict(unplaced)
        self.update = update
        self.last_step_s: float | None = None
        self.step_times: list[float] = []

    @property
    def last_grad_norm(self) -> float:
        """The last step's global gradient norm (before clipping)."""
        return self.update.norm

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last step's update was skipped: its loss or gradients were not finite."""
        return self.update.skipped

    # ------------------------------------------------------------------ building

    @classmethod
    def from_plan(
        cls,
        model: nn.Module,
        plan: Plan,
        *,
        loss_fn: LossFn,
        optimizer: OptimizerFactory,
        sample: tuple[tuple[Any, ...], dict[str, Any]],
        backend: str | None = None,
        split: str = "auto",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        init_from: str | None = None,
        clip_grad_norm: float | None = None,
        on_nonfinite: str = "stop",
    ) -> ParallelModel:
        """Check the plan against the model, join the mesh, build this rank's stage.

        Example::

            pmodel = ParallelModel.from_plan(
                model, load_plan("plan.yaml"), loss_fn=F.cross_entropy,
                optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-4), sample=((x,), {}))
            for x, y in loader:
                loss = pmodel.step(x, y)

        Args:
            model: the whole model, built identically (same seed) on every rank.
                This rank's stage shares its tensors: after training, read
                weights through :meth:`state_dict`, not ``model``.
            plan: the plan (``load_plan``), made for this model.
            loss_fn: ``loss_fn(outputs, targets)``, the mean over its micro-batch
                (see [Note: one loss-normalisation rule]). ``outputs`` is what
                the model returns (a tensor, tuple, dict or ModelOutput: the
                same object one process would pass), on the last stage.
            optimizer: builds the optimizer from this stage's parameters.
            sample: ``(args, kwargs)`` of the forward: one micro-batch, or a
                larger batch whose first ``plan.micro_batch_size`` samples are used.
            backend: "nccl" or "gloo" (default: nccl with CUDA, else gloo).
            split: "auto", "pipeline" or "fx" (see ``runtime.split``).
            timeout_s: how long a collective waits on a peer before failing.
            init_from: fill the stage by name from this file or folder (runtime.materialize).
            clip_grad_norm, on_nonfinite: clip the global gradient norm to this;
                "stop" or "skip" a non-finite step (``runtime.gradients``).

        Precision and recompute run as priced (``runtime.precision``,
        ``runtime.recompute``); pp = 1 runs the model itself (``runtime.accumulate``).

        Raises:
            PlanMismatch: the plan was made for another model, or the world size
                is not pp × dp. Raised on every rank before any communication.
            ValueError: a bad sample, schedule or device.
            StageError: the model cannot be split at the plan's split points.
        """
        check_schedule(plan)
        check_training(plan)
        check_gradient_options(clip_grad_norm, on_nonfinite)
        example = _micro_batch(sample, plan.micro_batch_size)
        weights, example = stage_weights(init_from, model, example)
        check_plan(plan, model, backend=backend)
        sets = tied_sets(plan, model)
        canonical = _canonical_names(model)
        mesh = init_mesh(plan, backend=backend, timeout_s=timeout_s)
        stages = _stages(model, plan, mesh, example, split, weights)
        held = {canonical[n] for names in stages[0].held for n in names if n in canonical}
        unplaced = {
            k: v.detach() if weights else v.detach().cpu().clone()
            for k, v in model.state_dict().items()
            if mesh.rank == 0 and canonical[k] == k and k not in held
        }
        unplaced = weights.values(unplaced) if weights else unplaced  # from the file
        tied = build_tied(sets, stages, mesh)
        params, shares = stepped_params(stages, mesh, plan.dp_mode)  # ZeRO-1: a share
        opt = optimizer(params) if params else None
        update = GradientStep(stages, tied, mesh, opt, clip_grad_norm=clip_grad_norm,
            on_nonfinite=on_nonfinite, after_step=shares.send if shares else None)  # fmt: skip
        schedule = make_schedule(plan, stages, loss_fn)
        return cls(
            plan=plan, mesh=mesh, stages=stages, tied=tied, schedule=schedule, optimizer=opt,
            canonical=canonical, unplaced=unplaced, update=update,
        )  # fmt: skip

    # ------------------------------------------------------------------ training

    def step(self, inputs: Any, targets: Tensor) -> float:
        """One optimizer step; returns the global batch's mean loss, on every rank.

        Example::

            loss = pmodel.step(x, y)     # x, y: the global batch, the same on every rank

        Args:
            inputs: the forward's inputs: a Tensor, a tuple/list (positional
                arguments) or a dict (keyword arguments). Either the GLOBAL
                batch (the same on every rank; replica r takes samples
                r·B/dp … (r+1)·B/dp) or exactly this replica's shard (B/dp).
            targets: a Tensor, batch first, for the loss.

        After the backward the loss and the global gradient norm are checked:
        a NaN or infinite one stops training (:class:`NonFiniteError`, on every
        rank, before the optimizer step) or skips the update, as
        ``on_nonfinite`` says; then the gradients are clipped (``clip_grad_norm``)
        and the optimizer steps.

        Raises:
            ValueError: a batch of another size (before any communication).
            NonFiniteError: the loss or the gradients are not finite (``on_nonfinite="stop"``).
        """
        t0 = time.perf_counter()
        args, kwargs = normalize_inputs(inputs)
        args, kwargs, targets = self._shard(args, kwargs, targets)
        mesh = self.mesh
        for st in self.stages:
            st.module.zero_grad(set_to_none=True)
        losses: list[Tensor] = []
        call = self.schedule.step
        first, last = mesh.is_first_stage, mesh.is_last_stage
        if first:
            args, kwargs = _to(args, mesh.device), _to(kwargs, mesh.device)
        if last:
            targets = targets.to(mesh.device)
        with autocast(self.plan, mesh.device):  # [Note: bf16-mixed as it runs]
            if first and last:
                call(*args, target=targets, losses=losses, return_outputs=False, **kwargs)
            elif first:
                call(*args, return_outputs=False, **kwargs)
            elif last:
                call(target=targets, losses=losses, return_outputs=False)
            else:
                call(return_outputs=False)
        self.tied.sync_grads()
        loss = self._reduce_loss(losses)
        self.update(loss)  # checks, clipping, the optimizer step (runtime.gradients)
        self.last_step_s = time.perf_counter() - t0
        self.step_times.append(self.last_step_s)
        return loss

    def _shard(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], targets: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any], Tensor]:
        """Check the batch size (reliability item 19) and take this replica's shard."""
        plan = self.plan
        size = batch_size_of(args, kwargs)
        shard = plan.global_batch // plan.dp
        if size not in (plan.global_batch, shard):
            sizes = f"{plan.global_batch}" + (
                f" (global) or {shard} (one replica's shard)" if plan.dp > 1 else ""
            )
            raise ValueError(
                f"the batch has {size} samples, but the plan trains on {sizes}: global batch "
                f"{plan.global_batch} = dp {plan.dp} × {plan.micro_batches} micro-batches × "
                f"{plan.micro_batch_size} samples.\n  fix: pass batches of {plan.global_batch} "
                "samples (the same on every rank); drop or pad a short last batch (e.g. "
                "DataLoader(drop_last=True)); or re-plan for another batch size"
            )
        if not isinstance(targets, Tensor) or targets.dim() == 0 or targets.shape[0] != size:
            got = tuple(targets.shape) if isinstance(targets, Tensor) else type(targets).__name__
            raise ValueError(
                f"targets must be one tensor with the batch ({size}) as dim 0, got {got}"
            )
        if size == plan.global_batch and plan.dp > 1:
            lo, hi = self.mesh.replica * shard, (self.mesh.replica + 1) * shard
            args, kwargs, targets = slice_batch((args, kwargs, targets), lo, hi, size)
        return args, kwargs, targets

    def _reduce_loss(self, losses: list[Tensor]) -> float:
        mesh = self.mesh
        if mesh.is_last_stage:
            value = torch.stack([x.detach().float().reshape(()) for x in losses]).mean()
            value = value.reshape(1)
        else:
            value = torch.zeros(1, device=mesh.device)
        if mesh.pp > 1:
            last = mesh.rank_of(mesh.replica, mesh.num_stages - 1)
            dist.broadcast(value, src=last, group=mesh.pp_group)
        if mesh.dp > 1:
            dist.all_reduce(value, group=mesh.dp_group)
            value /= mesh.dp
        return float(value.item())

    # ------------------------------------------------------------------ state

    def stage_state_dict(self) -> dict[str, Tensor]:
        """This rank's stages: parameters and persistent buffers under the model's names.

        A tied parameter appears under its first name in the model (e.g.
        ``tok_emb.weight`` even on the stage that uses it as ``head.weight``).
        Tensors are detached, on the stage's device. No communication: with
        ``dp_mode: fsdp`` the parameters are this replica's shards (DTensors).
        """
        out: dict[str, Tensor] = {}
        for st in self.stages:
            for name, value in st.module.state_dict().items():
                key = self._canonical.get(name)
                if key is not None:
                    out.setdefault(key, value.detach())
        return out

    def state_dict(self) -> dict[str, Tensor]:
        """The whole model's state on rank 0 (CPU tensors); ``{}`` on the other ranks.

        A collective: every rank must call it. Keys are the model's own, in
        ``model.state_dict()`` order, each tied tensor once (under its first
        name); ``model.load_state_dict(sd, strict=False)`` restores it.
        Replica 0's stages are gathered (with FSDP each stage's replicas first gather
        its shards together).
        """
        # FSDP: every replica gathers its stages' shards with the others (same keys, order).
        stage = {k: whole(v) for k, v in self.stage_state_dict().items()}
        mine = {k: v.cpu() for k, v in stage.items()} if self.mesh.replica == 0 else None
        rank = self.mesh.rank
        parts: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(mine, parts, dst=0)
        if rank != 0:
            return {}
        assert parts is not None
        merged: dict[str, Tensor] = {}
        for part in parts:
            for k, v in (part or {}).items():
                merged.setdefault(k, v)
        for k, v in self._unplaced.items():
            merged.setdefault(k, v)
        return {k: merged[k] for k in self._order if k in merged}

    def close(self) -> None:
        """Tear down the process group, if ``from_plan`` created it."""
        if self.mesh.owns_default_group and dist.is_initialized():
            dist.destroy_process_group()


# --------------------------------------------------------------------------- helpers


def _stages(
    model: nn.Module, plan: Plan, mesh: Mesh, example: Any, split: str, weights: Any
) -> tuple[StageModule, ...]:
    """This rank's stages: the model itself when pp = 1 (``runtime.accumulate``), else split."""
    if plan.pp == 1:  # no split, no schedule: the model under DDP
        if weights is not None:
            weights(model, mesh.device)
        stages: tuple[StageModule, ...] = (build_whole(model, plan, mesh),)
    else:
        stages = build_stages(model, plan, mesh, example, split=split, materialize=weights)
    for st in stages:
        compress_gradients(st.wrapped, plan, mesh.dp_group)  # bf16-mixed: bf16 all-reduce
    return stages


def _micro_batch(
    sample: tuple[tuple[Any, ...], dict[str, Any]], size: int
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The first ``size`` samples of ``sample``: the micro-batch ``pipeline`` traces."""
    if not (isinstance(sample, tuple) and len(sample) == 2 and isinstance(sample[1], Mapping)):
        raise ValueError(
            "sample must be (args, kwargs) of the forward, e.g. ((x,), {}); got "
            f"{type(sample).__name__}"
        )
    args, kwargs = tuple(sample[0]), dict(sample[1])
    have = batch_size_of(args, kwargs)
    if have < size:
        raise ValueError(
            f"the sample has {have} samples, fewer than one micro-batch ({size} in the plan); "
            f"pass at least {size}"
        )
    cut_args, cut_kwargs = slice_batch((args, kwargs), 0, size, have)
    return tuple(cut_args), dict(cut_kwargs)


def _canonical_names(model: nn.Module) -> dict[str, str]:
    """Every ``state_dict`` key → the first key of the same tensor (tied names fold)."""
    first: dict[int, str] = {}
    return {k: first.setdefault(id(v), k) for k, v in model.state_dict(keep_vars=True).items()}


def _to(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(_to(x, device) for x in obj)
    if isinstance(obj, list):
        return [_to(x, device) for x in obj]
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj
