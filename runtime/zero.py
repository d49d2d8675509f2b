"""ZeRO-1: the replicas of a stage share out its optimizer state, and send each other weights.

With ``layout.dp_mode: zero1`` every parameter tensor of a stage belongs to one
replica of it (``planner.plan.shares.owners``); that replica's optimizer alone
holds its state and steps it. Gradients stay whole on every replica (DDP's all-reduce, so the
global norm, clipping and the non-finite checks are unchanged); after the
step each replica sends the weights it stepped to the others
(:meth:`ShardedWeights.send`), one broadcast per replica and dtype, from one
flat buffer. The planner prices the same shares ([Note: ZeRO-1 shares] in
``planner.cost.basis``).

Checkpoints: each rank's optimizer state holds its own parameters' entries
under the model's names, so the ranks' parts merge into one (DCP writes each
key once): each rank of a run of the same plan loads its share back, and each
rank of a DDP run of the same layout the state of all its stage's parameters
(both tested: tests/runtime/test_zero1_runs.py); with another dp: not tested.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from planner.plan.shares import owners
from runtime.mesh import Mesh
from runtime.stage import StageModule

__all__ = ["ShardedWeights", "stepped_params"]


def stepped_params(
    stages: Sequence[StageModule], mesh: Mesh, dp_mode: str
) -> tuple[list[nn.Parameter], ShardedWeights | None]:
    """The parameters this rank's optimizer steps (each tensor once), and with ZeRO-1 the
    shares whose weights are sent after each step (None with DDP, or dp 1)."""
    if dp_mode == "zero1" and mesh.dp > 1:
        shares = ShardedWeights(stages, mesh)
        return shares.mine, shares
    return list({id(p): p for st in stages for p in st.trainable()}.values()), None


class ShardedWeights:
    """This rank's share of its stages' parameters, and the weights' exchange after a step.

    Example::

        shares = ShardedWeights(stages, mesh)
        opt = make_optimizer(shares.mine) if shares.mine else None
        ...; opt.step(); shares.send()

    Attributes:
        mine: the parameters this replica steps (its optimizer's), in model order.
        shares: per replica of the dp group, the parameters it owns.
    """

    def __init__(self, stages: Sequence[StageModule], mesh: Mesh) -> None:
        self.mesh = mesh
        self.shares: list[list[nn.Parameter]] = [[] for _ in range(mesh.dp)]
        seen: set[int] = set()
        for st in stages:  # each stage apart, as the planner prices each stage's share
            params = [p for p in st.trainable() if id(p) not in seen]
            seen |= {id(p) for p in params}
            who = owners([p.numel() * p.element_size() for p in params], mesh.dp)
            for p, r in zip(params, who, strict=True):
                self.shares[r].append(p)
        self.mine = self.shares[mesh.replica]
        # Per broadcast, made once: its sender, dtype, parameters and their sizes.
        self._sends: list[tuple[int, torch.dtype, list[nn.Parameter], list[int]]] = []
        for r, share in enumerate(self.shares):
            for dtype in dict.fromkeys(p.dtype for p in share):
                params = [p for p in share if p.dtype == dtype]
                self._sends.append((r, dtype, params, [p.numel() for p in params]))

    def send(self) -> None:
        """Every replica's stepped weights to the others (a collective over the dp group)."""
        group = self.mesh.dp_group
        for r, dtype, params, sizes in self._sends:
            if r == self.mesh.replica:
                flat = torch.cat([p.detach().reshape(-1) for p in params])
            else:
                flat = torch.empty(sum(sizes), dtype=dtype, device=params[0].device)
            dist.broadcast(flat, group=group, group_src=r)
            if r != self.mesh.replica:
                with torch.no_grad():
                    for p, got in zip(params, flat.split(sizes), strict=True):
                        p.copy_(got.view_as(p))
