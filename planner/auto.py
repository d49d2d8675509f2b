"""``auto_parallel``: plan a model for the processes this job has, and run it. One call.

The one module that imports both the planner and the runtime.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from planner.devices.build import from_gpus
from planner.devices.cluster import Cluster
from planner.options import PlanOptions, ProfileOptions, SearchOptions, Training
from planner.plan.batch import batch_size_of, normalize_inputs
from planner.plan.default_loss import default_loss
from planner.plan.files import load_plan
from planner.plan.schema import Plan
from planner.planning import plan_model
from runtime.checks import default_backend
from runtime.engine import ParallelModel
from runtime.options import DEFAULT_TIMEOUT_S

__all__ = ["PLAN_TIMEOUT_S", "auto_parallel"]

log = logging.getLogger(__name__)

PLAN_TIMEOUT_S = 1800.0
"""How long the other ranks wait for rank 0 to plan (profiling and solving), seconds."""

_OPTIMIZER_NAMES = {torch.optim.Adam: "adam", torch.optim.AdamW: "adamw", torch.optim.SGD: "sgd"}


def auto_parallel(
    model: nn.Module,
    sample: tuple[Any, Any],
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    plan: Plan | str | os.PathLike[str] | None = None,
    cluster: Cluster | None = None,
    global_batch: int | None = None,
    *,
    backend: str | None = None,
    split: str = "auto",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    clip_grad_norm: float | None = None,
    on_nonfinite: str = "stop",
    **plan_options: Any,
) -> ParallelModel:
    """Plan ``model`` for this job's processes (or take ``plan``) and build its ``ParallelModel``.

    Example (the same script under ``torchrun --nproc-per-node 4`` or alone)::

        torch.manual_seed(0)                       # the same model on every rank
        model = build_model()
        pmodel = auto_parallel(model, sample=(x, y), loss_fn=F.cross_entropy,
                               optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-4))
        for x, y in batches:                       # global batches, the same on every rank
            loss = pmodel.step(x, y)
        pmodel.close()

    Inside a torchrun job (``WORLD_SIZE`` > 1) rank 0 plans for ``WORLD_SIZE``
    local devices (``from_gpus``), so that pp × dp = the world size, or loads
    ``plan``, and broadcasts it (over gloo): every rank builds the same
    placement, or raises rank 0's planning error. One process: pp = dp = 1.

    Args:
        model: the whole model, built identically on every rank (seed first).
        sample: one global batch ``(inputs, targets)``: profiled for the plan
            (sliced into micro-batches) and traced to split the model.
            ``inputs`` is a Tensor, a tuple (positional) or a dict (keyword).
        loss_fn: ``loss_fn(outputs, targets)``, a mean over the micro-batch
            (default: ``planner.plan.default_loss.default_loss``).
        optimizer: builds the optimizer from a stage's parameters (default:
            Adam, lr 1e-3). The plan budgets memory for its kind (Adam, AdamW
            or SGD with momentum; others are budgeted as Adam).
        plan: a Plan or a plan file to run instead of planning.
        cluster: the devices to plan for (default: ``from_gpus(world size)``).
        global_batch: samples per step (default: the sample's batch size).
        backend, split, timeout_s, clip_grad_norm, on_nonfinite: as ``ParallelModel.from_plan``.
        **plan_options: fields of ``Training`` (precision, memory_headroom),
            ``SearchOptions`` (pp, dp, micro_batches, schedule, solver,
            time_limit_s, ...) and ``ProfileOptions`` (repeats, warmup, ...).

    Raises:
        TypeError: an unknown keyword in ``plan_options``.
        ValueError: planning failed, or the plan does not fit this job
            (raised on every rank with the same message).
    """
    loss = loss_fn or default_loss
    make_opt = optimizer or (lambda ps: torch.optim.Adam(ps, lr=1e-3))
    _split_options(plan_options)  # unknown keywords fail on every rank, before any communication
    world = int(os.environ.get("WORLD_SIZE", "1"))
    created = world > 1 and not dist.is_initialized()
    if created:
        dist.init_process_group(backend or default_backend(), timeout=timedelta(seconds=timeout_s))
    chosen = _from_rank0(
        lambda: _resolve(
            model, sample, loss, make_opt, plan, cluster, global_batch, world, plan_options
        ),
        world,
    )
    pmodel = ParallelModel.from_plan(
        model, chosen, loss_fn=loss, optimizer=make_opt, sample=normalize_inputs(sample[0]),
        backend=backend, split=split, timeout_s=timeout_s, clip_grad_norm=clip_grad_norm,
        on_nonfinite=on_nonfinite,
    )  # fmt: skip
    if created:  # close() tears down the group this call created
        pmodel.mesh = dataclasses.replace(pmodel.mesh, owns_default_group=True)
    return pmodel


def _resolve(
    model: nn.Module,
    sample: tuple[Any, Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    make_opt: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    plan: Plan | str | os.PathLike[str] | None,
    cluster: Cluster | None,
    global_batch: int | None,
    world: int,
    plan_options: dict[str, Any],
) -> Plan:
    """The plan to run: ``plan`` itself, or a new one for ``world`` devices."""
    if isinstance(plan, Plan):
        chosen = plan
    elif plan is not None:
        chosen = load_plan(Path(plan))
    else:
        training_kw, search_kw, profile_kw = _split_options(plan_options)
        if world == 1:
            search_kw.update(pp=1, dp=1)
        search_kw.setdefault("every_device", True)  # the job's process count is fixed
        pp, dp = search_kw.get("pp"), search_kw.get("dp")
        if pp is not None and dp is not None and pp * dp != world:
            raise ValueError(
                f"pp {pp} × dp {dp} = {pp * dp} processes, but this job has {world}; pin pp "
                f"and dp whose product is {world}, or pin only one"
            )
        batch = global_batch or batch_size_of(*normalize_inputs(sample[0]))
        options = PlanOptions(
            training=Training(
                global_batch=batch, optimizer=_optimizer_name(make_opt), **training_kw
            ),
            search=SearchOptions(**search_kw),
            profile=ProfileOptions(**profile_kw),
        )
        chosen = plan_model(
            model,
            sample,
            cluster=cluster or from_gpus(world),
            loss_fn=loss_fn,
            options=options,
        )
    if chosen.world_size != world:
        raise ValueError(
            f"the plan runs pp {chosen.pp} × dp {chosen.dp} = {chosen.world_size} processes, "
            f"but this job has {world}; start {chosen.world_size} (torchrun --nproc-per-node "
            f"{chosen.world_size}) or plan for {world} (a cluster of {world} devices)"
        )
    return chosen


def _from_rank0(resolve: Callable[[], Plan], world: int) -> Plan:
    """Rank 0 resolves the plan; every rank gets it (or rank 0's error, as a ValueError).

    With one process, the plan is resolved here and nothing is sent.
    """
    if world == 1:
        return resolve()
    rank = dist.get_rank()
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=PLAN_TIMEOUT_S))
    box: list[Any] = [None]
    failure: BaseException | None = None
    if rank == 0:
        try:
            box[0] = ("plan", resolve().to_dict())
        except Exception as exc:  # every rank must leave the broadcast, then raise
            failure = exc
            box[0] = ("error", f"{type(exc).__name__}: {exc}")
    dist.broadcast_object_list(box, src=0, group=group)
    # The group is kept (``ParallelModel.close`` tears down every group): destroying a gloo
    # group right after a collective can deadlock (runtime/worker.py, [Note: a bounded exit]).
    kind, payload = box[0]
    if kind == "error":  # the same message on every rank; rank 0 chains its own exception
        raise ValueError(f"planning on rank 0 failed: {payload}") from failure
    return Plan.from_dict(payload, source="the plan broadcast by rank 0")


def _split_options(
    options: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``plan_options`` sorted into Training, SearchOptions and ProfileOptions keywords."""
    names = [
        {f.name for f in dataclasses.fields(cls)} - {"global_batch", "optimizer"}
        for cls in (Training, SearchOptions, ProfileOptions)
    ]
    unknown = sorted(set(options) - set().union(*names))
    if unknown:
        raise TypeError(
            f"auto_parallel() got unknown plan option(s) {unknown}; it takes the fields of "
            f"Training {sorted(names[0])}, SearchOptions {sorted(names[1])} and "
            f"ProfileOptions {sorted(names[2])}"
        )
    split = tuple({k: v for k, v in options.items() if k in n} for n in names)
    return split[0], split[1], split[2]


def _optimizer_name(make_opt: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]) -> str:
    """The planner's name for the optimizer ``make_opt`` builds (its state per parameter)."""
    probe = make_opt([nn.Parameter(torch.zeros(1))])
    for cls, name in _OPTIMIZER_NAMES.items():
        if type(probe) is cls:
            return name
    log.info("optimizer %s: memory budgeted as Adam's", type(probe).__name__)
    return "adam"
