"""The dp × pp device mesh a plan runs on.

After the checks (:mod:`runtime.checks`), :func:`init_mesh` joins the process
group torchrun describes and lays the ranks out as the plan says:
``mesh.grid[r][s]`` is the rank running stage ``s`` of replica ``r``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from planner.plan.schema import Plan
from runtime.checks import check_world, default_backend, local_device
from runtime.options import DEFAULT_TIMEOUT_S
from runtime.rendezvous import is_loopback, listening_store

__all__ = ["Mesh", "init_mesh"]

log = logging.getLogger(__name__)


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
