"""The checks before any communication: the plan fits this model, this launch, this machine.

Every rank runs :func:`check_plan` before ``init_process_group``: a plan made
for another model, or a launch with the wrong number of processes, fails on
every rank with the same message and nothing waits on a peer that will never
come. The model is identified by its structural fingerprint
(:mod:`planner.plan.fingerprint`): no trace, the same on every rank.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from torch import nn

from planner.plan.fingerprint import describe_mismatch, fingerprint
from planner.plan.schema import Plan

__all__ = [
    "PlanMismatch",
    "check_device",
    "check_plan",
    "check_world",
    "default_backend",
    "local_device",
]

log = logging.getLogger(__name__)


class PlanMismatch(ValueError):
    """The plan does not fit this model or this launch; the message says what differs."""


def default_backend() -> str:
    """ "nccl" when CUDA is available, else "gloo": one code path for GPU and CPU."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def local_device(backend: str | None = None) -> torch.device:
    """``cuda:LOCAL_RANK`` for NCCL, else the CPU.

    Raises:
        ValueError: NCCL without CUDA, or LOCAL_RANK beyond the visible GPUs.
    """
    backend = backend or default_backend()
    if backend != "nccl":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(
            "backend 'nccl' needs CUDA, but torch.cuda.is_available() is False on this "
            "machine; use backend='gloo' to run on the CPU, or install a CUDA build of torch"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ValueError(
            f"LOCAL_RANK is {local_rank} but only {count} CUDA device(s) are visible; start at "
            f"most {count} processes per node (torchrun --nproc-per-node {count}) or check "
            "CUDA_VISIBLE_DEVICES"
        )
    return torch.device("cuda", local_rank)


def check_device(
    plan: Plan, *, allow_mismatch: bool = False, gpu_name: str | None = None
) -> str | None:
    """Compare the plan's device types with this machine's; refuse a GPU plan without a GPU.

    Example::

        note = check_device(plan)          # on rank 0 and in planner run, before launching
        if note:
            log.warning("%s", note)

    Args:
        allow_mismatch: ``--allow-device-mismatch``: run a GPU plan on the CPU anyway.
        gpu_name: this machine's GPU (``torch.cuda.get_device_name(0)``; "" for none).
            Default: asked of torch.

    Returns:
        A warning to print, or None: a CPU plan on a GPU, or a GPU of another type than
        the plan's (judged by name: ``h100`` in ``NVIDIA H100 80GB HBM3``), or a GPU
        plan forced onto the CPU. The run goes on, but the plan's predictions are not
        for this hardware.

    Raises:
        PlanMismatch: a GPU plan on a machine without a CUDA GPU, not forced.
    """
    kinds = sorted({g.type for node in plan.cluster.nodes for g in node.devices})
    gpus = [k for k in kinds if k != "cpu"]
    if gpu_name is None:
        gpu_name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    of = f" of {plan.model.file}" if plan.model.file else ""
    made = f"the plan{of} was made for {' and '.join(kinds)} devices"
    replan = "re-plan on this machine (`planner plan model.py --out plan.yaml`)"
    if not gpu_name:
        if not gpus:
            return None
        text = (
            f"{made}, but this machine has no CUDA GPU (torch.cuda.is_available() is False), "
            "so it would run on the CPU, far from the plan's predicted times and memory"
        )
        if not allow_mismatch:
            raise PlanMismatch(
                f"{text}; run it where its GPUs are, {replan}, or pass "
                "--allow-device-mismatch to run it here anyway"
            )
        return f"{text} (--allow-device-mismatch)"
    if not gpus:
        return (
            f"{made}, but runs on this machine's GPU ({gpu_name}): the predicted times and "
            f"memory are the CPU's; {replan} for the GPU's"
        )
    compact = gpu_name.lower().replace(" ", "")
    if not any(k.lower() in compact for k in gpus):
        return (
            f"{made}, but this machine's GPU is {gpu_name}: the predicted times and memory "
            f"are for {' and '.join(gpus)}; {replan} for this one"
        )
    return None


def check_world(plan: Plan, world_size: int | None = None) -> int:
    """Refuse a launch whose world size is not the plan's ``pp × dp``.

    Example::

        check_world(plan)           # reads WORLD_SIZE, as torchrun sets it

    Args:
        world_size: the number of processes; default: the initialized process
            group's, else ``WORLD_SIZE`` from the environment (1 when unset).

    Returns:
        The world size.

    Raises:
        PlanMismatch: the sizes differ; the message gives both and the command.
    """
    if world_size is None:
        if dist.is_available() and dist.is_initialized():
            world_size = dist.get_world_size()
        else:
            world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size != plan.world_size:
        raise PlanMismatch(
            f"the plan runs pp {plan.pp} × dp {plan.dp} = {plan.world_size} processes, but "
            f"this launch has world size {world_size}.\n"
            f"  fix: start {plan.world_size} processes, e.g. `torchrun --nproc-per-node "
            f"{plan.world_size} -m runtime model.py --plan plan.yaml` or `planner run "
            "model.py --plan plan.yaml`; or re-plan for this many devices "
            f"(`planner plan model.py --gpus {world_size}`)"
        )
    return world_size


def check_plan(
    plan: Plan,
    model: nn.Module,
    *,
    world_size: int | None = None,
    backend: str | None = None,
) -> None:
    """Check that ``plan`` was made for ``model`` and fits this launch; no communication.

    Example::

        check_plan(plan, model)   # on every rank, before init_mesh

    Compares the model's structural fingerprint with the plan's. On a mismatch
    the message says *what* differs: parameters missing from the model, extra
    ones, or of other shapes (a few of each, with counts), or, when the
    parameters agree, that the module tree, a buffer or a dtype does. A plan of
    format 1 or 2 records no structural fingerprint: its parameter names and
    shapes are compared, and a warning says to re-plan. Then checks the world
    size (:func:`check_world`) and the backend's device (:func:`local_device`).

    Raises:
        PlanMismatch: the model or the world size does not match the plan.
        ValueError: the backend's device is missing.
    """
    if plan.fingerprint is None:
        differ = describe_mismatch(plan.model.parameter_shapes, model)
        if differ or not plan.model.parameter_shapes:
            raise PlanMismatch(_mismatch(plan, model, differ, None))
        log.warning(
            "%s is a format %d plan: it has no structural fingerprint, so only its %d "
            "parameter names and shapes were checked against the model; re-plan "
            "(`planner plan`) for the full check",
            plan.model.file or "the plan",
            plan.version,
            len(plan.model.parameter_shapes),
        )
    else:
        found = fingerprint(model)
        if found != plan.fingerprint:
            differ = describe_mismatch(plan.model.parameter_shapes, model)
            raise PlanMismatch(_mismatch(plan, model, differ, found))
    check_world(plan, world_size)
    local_device(backend)


def _mismatch(plan: Plan, model: nn.Module, differ: list[str], found: str | None) -> str:
    where = plan.model.file or "the plan"
    if found is None:
        head = (
            f"{where} (format {plan.version}, no structural fingerprint) was made for another "
            "model."
        )
    else:
        head = (
            f"{where} was made for another model: fingerprint {plan.fingerprint} in the plan, "
            f"{found} for this model."
        )
    fix = (
        "  fix: re-plan this model (`planner plan model.py --out plan.yaml`), or load the "
        "model the plan was made for (same code, same configuration)"
    )
    if not plan.model.parameter_shapes:
        return f"{head}\n  (the plan records no parameter shapes to compare)\n{fix}"
    lines = [head, *(f"  {line}" for line in differ)]
    if not differ:
        n = sum(1 for _ in model.named_parameters(remove_duplicate=False))
        lines.append(
            f"  all {n} parameters agree in name and shape, so the module tree (a module's "
            "class or name), a buffer, a parameter dtype or the tying of weights differs"
        )
    lines.append(fix)
    return "\n".join(lines)
