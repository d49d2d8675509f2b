"""The checks before any communication, and the dp × pp device mesh a plan runs on.

Every rank runs :func:`check_plan` before ``init_process_group``: a plan made
for another model, or a launch with the wrong number of processes, fails on
every rank with the same message and nothing waits on a peer that will never
come. :func:`init_mesh` then joins the process group torchrun describes and
lays the ranks out as the plan says: ``mesh[r][s]`` is the rank running stage
``s`` of replica ``r``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from planner.capture import capture, fingerprint
from planner.plan import Plan

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "Mesh",
    "PlanMismatch",
    "check_plan",
    "check_world",
    "default_backend",
    "init_mesh",
    "local_device",
]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0
"""How long a collective may wait on a peer before every rank gives up (seconds).

A rank that raises leaves its peers blocked in their next collective; this
bound is how long they wait before they fail too (reliability item 18).
"""

_SHOW = 5  # names listed per kind of difference


class PlanMismatch(ValueError):
    """The plan does not fit this model or this launch; the message says what differs."""


# --------------------------------------------------------------------------- devices


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


# --------------------------------------------------------------------------- checks


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
    sample_args: tuple[Any, ...],
    sample_kwargs: dict[str, Any] | None = None,
    *,
    world_size: int | None = None,
    backend: str | None = None,
) -> None:
    """Check that ``plan`` was made for ``model`` and fits this launch; no communication.

    Example::

        check_plan(plan, model, (tokens,), {})   # on every rank, before init_mesh

    Compares the model's fingerprint with the plan's. On a mismatch the message
    says *what* differs: parameters missing from the model, extra ones, or of
    other shapes (a few of each, with counts), or — when the parameters agree —
    that the forward's graph (or a buffer, or a dtype) differs. Then checks the
    world size (:func:`check_world`) and the backend's device
    (:func:`local_device`).

    Raises:
        PlanMismatch: the model or the world size does not match the plan.
        ValueError: the backend's device is missing.
    """
    # capture() restores only the root's train/eval flag (model.train(was)); keep every
    # submodule's own flag (e.g. BatchNorm in eval inside a training model).
    modes = [(m, m.training) for m in model.modules()]
    try:
        cap = capture(model, tuple(sample_args), dict(sample_kwargs or {}))
        found = fingerprint(cap, model)
    finally:
        for m, training in modes:
            m.training = training
    if found != plan.fingerprint:
        raise PlanMismatch(_describe_mismatch(plan, model, found))
    check_world(plan, world_size)
    local_device(backend)


def _describe_mismatch(plan: Plan, model: nn.Module, found: str) -> str:
    where = plan.model.get("file") or "the plan"
    head = (
        f"{where} was made for another model: fingerprint {plan.fingerprint} in the plan, "
        f"{found} for this model."
    )
    fix = (
        "  fix: re-plan this model (`planner plan model.py --out plan.yaml`), or load the "
        "model the plan was made for (same code, same configuration)"
    )
    have = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    want = {n: tuple(s) for n, s in plan.parameter_shapes.items()}
    if not want:
        return f"{head}\n  (the plan records no parameter shapes to compare)\n{fix}"
    missing = [n for n in want if n not in have]
    extra = [n for n in have if n not in want]
    reshaped = [n for n in want if n in have and have[n] != want[n]]
    lines = [head]
    if missing:
        lines.append(
            f"  {len(missing)} parameter(s) in the plan are missing from the model: {_few(missing)}"
        )
    if extra:
        lines.append(f"  {len(extra)} parameter(s) of the model are not in the plan: {_few(extra)}")
    if reshaped:
        shown = [f"{n} {list(want[n])} in the plan, {list(have[n])} here" for n in reshaped]
        lines.append(f"  {len(reshaped)} parameter(s) have other shapes: {_few(shown)}")
    if len(lines) == 1:
        lines.append(
            f"  all {len(have)} parameters agree in name and shape, so the forward's graph "
            "differs (other operations or module calls), or a buffer or a parameter dtype does"
        )
    lines.append(fix)
    return "\n".join(lines)


def _few(items: list[str]) -> str:
    more = f" (+{len(items) - _SHOW} more)" if len(items) > _SHOW else ""
    return ", ".join(items[:_SHOW]) + more


# --------------------------------------------------------------------------- the mesh


@dataclass(frozen=True, kw_only=True, eq=False)
class Mesh:
    """Where this rank sits: replica ``replica``, stage ``stage`` of a dp × pp grid.

    Attributes:
        rank: this process's global rank.
        replica, stage: its coordinates in the grid.
        pp, dp: pipeline depth and data-parallel width.
        device: where this rank's stage runs (``cuda:LOCAL_RANK`` or the CPU).
        backend: the process group's backend ("nccl" or "gloo").
        device_mesh: the 2-D ``DeviceMesh`` with dims ("dp", "pp").
        pp_group: the ranks of this replica's stages, in stage order.
        dp_group: the ranks running this stage, one per replica.
        grid: ``grid[r][s]``, the rank running stage s of replica r.
        owns_default_group: whether ``init_mesh`` created the default group.
    """

    rank: int
    replica: int
    stage: int
    pp: int
    dp: int
    device: torch.device
    backend: str
    device_mesh: DeviceMesh
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    grid: tuple[tuple[int, ...], ...]
    owns_default_group: bool = False

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pp - 1

    def rank_of(self, replica: int, stage: int) -> int:
        return self.grid[replica][stage]

    @property
    def prefix(self) -> str:
        """ "[rank 3 r1 s1]": the prefix of this rank's log lines."""
        return f"[rank {self.rank} r{self.replica} s{self.stage}]"


def init_mesh(
    plan: Plan, *, backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> Mesh:
    """Join the default process group (from torchrun's environment) and build the mesh.

    Example::

        mesh = init_mesh(plan)               # under torchrun --nproc-per-node pp*dp
        print(mesh.replica, mesh.stage, mesh.device)

    Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT when the
    default group is not yet initialized. A one-process plan also runs without
    torchrun (an in-process store).

    Args:
        backend: "nccl" or "gloo"; default :func:`default_backend`.
        timeout_s: how long a collective waits for a peer (see DEFAULT_TIMEOUT_S).

    Raises:
        PlanMismatch: the world size is not ``pp × dp``.
        ValueError: the backend's device is missing.
    """
    initialized = dist.is_initialized()
    if initialized:
        backend = str(dist.get_backend())
    backend = backend or default_backend()
    device = local_device(backend)
    owns = False
    if not initialized:
        check_world(plan)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = timedelta(seconds=timeout_s)
        if "MASTER_ADDR" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1:
            store = _loopback_store(timeout_s)
            if store is None:  # env:// (torchrun's variables), torch's own store
                dist.init_process_group(backend, timeout=timeout)
            else:
                dist.init_process_group(
                    backend,
                    store=store,
                    rank=int(os.environ["RANK"]),
                    world_size=int(os.environ["WORLD_SIZE"]),
                    timeout=timeout,
                )
        else:  # one process without torchrun (check_world: the plan wants one)
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
        owns = True
    else:
        check_world(plan, dist.get_world_size())
    rank = dist.get_rank()
    grid = tuple(tuple(row) for row in plan.ranks())
    coords = [(r, s) for r, row in enumerate(grid) for s, k in enumerate(row) if k == rank]
    assert len(coords) == 1, f"rank {rank} appears {len(coords)} times in {grid}"
    replica, stage = coords[0]
    device_mesh = DeviceMesh(
        device.type, mesh=torch.tensor(grid, dtype=torch.int), mesh_dim_names=("dp", "pp")
    )
    mesh = Mesh(
        rank=rank,
        replica=replica,
        stage=stage,
        pp=plan.pp,
        dp=plan.dp,
        device=device,
        backend=backend,
        device_mesh=device_mesh,
        pp_group=device_mesh.get_group("pp"),
        dp_group=device_mesh.get_group("dp"),
        grid=grid,
        owns_default_group=owns,
    )
    log.info("%s mesh dp %d × pp %d on %s (%s)", mesh.prefix, plan.dp, plan.pp, device, backend)
    return mesh


def _loopback_store(timeout_s: float) -> dist.Store | None:
    """The default group's store, listening on MASTER_ADDR only when that is a loopback address.

    What ``init_process_group``'s ``env://`` would build (rank 0 hosts a
    TCPStore, the others connect; keys under the prefix "default_pg"), except
    that rank 0's server socket is bound to the loopback address rather than to
    every interface ([Note: a local run listens on loopback only] in
    ``runtime.rendezvous``). None when MASTER_ADDR is not a loopback address
    (a multi-machine run) or torchrun's agent hosts the store itself.
    """
    from runtime.rendezvous import is_loopback, listening_store

    addr = os.environ.get("MASTER_ADDR", "")
    if not is_loopback(addr) or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    port = int(os.environ["MASTER_PORT"])
    store: dist.Store
    if rank == 0:
        store = listening_store(
            addr, port, world_size=world, timeout_s=timeout_s, multi_tenant=True
        )
    else:
        store = dist.TCPStore(addr, port, world, False, timedelta(seconds=timeout_s))
    return dist.PrefixStore("default_pg", store)
