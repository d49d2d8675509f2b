"""The dp × pp device mesh a plan runs on.

After the checks (:mod:`runtime.checks`), :func:`init_mesh` joins the process
group torchrun describes and lays the ranks out as the plan says:
``mesh.grid[r][k]`` is the rank at position ``k`` of replica ``r``'s pipeline.
With one stage per rank (v = 1) position k runs stage k; with ``v`` stages per
rank (Interleaved 1F1B, Looped BFS) it runs the stages the schedule places
there (``plan.stage_ranks``: stage i on position i mod pp), and
:meth:`Mesh.rank_of` finds a stage's rank.
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

__all__ = ["Mesh", "init_mesh", "pipeline_grid"]

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- the mesh


@dataclass(frozen=True, kw_only=True, eq=False)
class Mesh:
    """Where this rank sits: replica ``replica``, pipeline position ``stage`` of a dp × pp grid.

    Attributes:
        rank: this process's global rank.
        replica, stage: its coordinates in the grid (``stage`` is the pipeline
            position, 0 … pp − 1: with v = 1 the stage it runs).
        stages: the stages this rank runs, in model order (``(stage,)`` when v = 1).
        stage_ranks: per stage of the model, the pipeline position running it
            (``plan.stage_ranks``).
        pp, dp: pipeline depth (ranks per replica) and data-parallel width.
        device: where this rank's stage runs (``cuda:LOCAL_RANK`` or the CPU).
        backend: the process group's backend ("nccl" or "gloo").
        device_mesh: the 2-D ``DeviceMesh`` with dims ("dp", "pp").
        pp_group: the ranks of this replica's stages, in stage order.
        dp_group: the ranks running this stage, one per replica.
        grid: ``grid[r][k]``, the rank at pipeline position k of replica r.
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
    stages: tuple[int, ...]
    stage_ranks: tuple[int, ...]
    owns_default_group: bool = False

    @property
    def num_stages(self) -> int:
        """The model's stages: pp · v."""
        return len(self.stage_ranks)

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank runs the model's first stage (it takes the inputs)."""
        return 0 in self.stages

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank runs the model's last stage (it takes the targets, has the losses)."""
        return self.num_stages - 1 in self.stages

    def rank_of(self, replica: int, stage: int) -> int:
        """The rank running ``stage`` (a stage of the model, 0 … pp·v − 1) of ``replica``."""
        return self.grid[replica][self.stage_ranks[stage]]

    @property
    def prefix(self) -> str:
        """ "[rank 3 r1 s1]" ("[rank 0 r0 s0,2]" with two stages per rank): log lines' prefix."""
        return f"[rank {self.rank} r{self.replica} s{','.join(map(str, self.stages))}]"


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
    grid = pipeline_grid(plan)
    coords = [(r, s) for r, row in enumerate(grid) for s, k in enumerate(row) if k == rank]
    assert len(coords) == 1, f"rank {rank} appears {len(coords)} times in {grid}"
    replica, stage = coords[0]
    on = plan.stage_ranks
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
        stages=tuple(i for i, k in enumerate(on) if k == stage),
        stage_ranks=tuple(on),
        owns_default_group=owns,
    )
    log.info("%s mesh dp %d × pp %d on %s (%s)", mesh.prefix, plan.dp, plan.pp, device, backend)
    return mesh


def pipeline_grid(plan: Plan) -> tuple[tuple[int, ...], ...]:
    """``grid[r][k]``: the rank at pipeline position k of replica r (from the stages' ranks).

    Example: interleaved-1f1b, pp 2 × v 2 × dp 2: ``plan.stage_ranks`` is
    (0, 1, 0, 1) and ``plan.ranks()`` [[0, 1, 0, 1], [2, 3, 2, 3]], so the grid
    is ((0, 1), (2, 3)).
    """
    on = plan.stage_ranks
    first = [on.index(k) for k in range(plan.pp)]
    return tuple(tuple(row[i] for i in first) for row in plan.ranks())


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
