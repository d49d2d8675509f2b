"""A stage's DDP broadcasts its buffers only when the forward writes one, on 2 processes (gloo).

[Note: the buffers DDP broadcasts] in runtime/stage.py. A constant buffer (a
position-ids table) is never broadcast; BatchNorm's running statistics are,
before every forward after the first, from rank 0, as plain DDP does.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from world import run_world

from runtime.stage import maybe_ddp

pytestmark = pytest.mark.multiprocess


class _Positions(nn.Module):
    """A linear layer plus a constant buffer, as BERT's position ids."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("ids", torch.arange(4.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x + self.ids)


def _wrapped(model: nn.Module) -> Any:
    mesh = SimpleNamespace(dp=2, device=torch.device("cpu"), dp_group=None, prefix="test")
    return maybe_ddp(model, mesh)  # type: ignore[arg-type]


def _batch(rank: int, k: int) -> torch.Tensor:
    return torch.full((8, 4), float(rank + 1)) + torch.linspace(0, k + 1, 32).view(8, 4)


def _counted(ddp: Any) -> list[int]:
    """Count the buffer broadcasts ``ddp`` makes."""
    calls = [0]
    inner = ddp._distributed_broadcast_coalesced

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return inner(*args, **kwargs)

    ddp._distributed_broadcast_coalesced = counting
    return calls


def _both() -> dict[str, Any]:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    constant = _wrapped(_Positions())
    constant_calls = _counted(constant)
    for k in range(3):
        constant(_batch(rank, k)).sum().backward()

    torch.manual_seed(0)
    norm = nn.BatchNorm1d(4)
    ddp = _wrapped(nn.Sequential(nn.Linear(4, 4), norm))
    reference = nn.BatchNorm1d(4)  # rank 0's statistics after its first batch, then ours
    reference.load_state_dict(norm.state_dict())
    first = ddp.module[0](_batch(0, 0)).detach()
    norm_calls = _counted(ddp)
    ddp.eval()  # an evaluation first (BatchNorm writes nothing): it decides nothing
    with torch.no_grad():
        ddp(_batch(rank, 0))
    undecided = ddp.writes_buffers
    ddp.train()
    for k in range(2):
        ddp(_batch(rank, k)).sum().backward()
    with torch.no_grad():
        reference(first)
        reference(ddp.module[0](_batch(rank, 1)))
    out = {
        "constant": (constant.writes_buffers, constant_calls[0]),
        "norm": (undecided, ddp.writes_buffers, norm_calls[0]),
        "stats": (norm.running_mean.clone(), reference.running_mean.clone()),
    }
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(120)
def test_only_written_buffers_are_broadcast() -> None:
    for rank, got in enumerate(run_world(_both, 2, timeout_s=90)):
        assert got["constant"] == (False, 0), rank  # a constant buffer: no broadcast at all
        assert got["norm"] == (None, True, 1), rank  # written: broadcast before the second
        # ...so every rank starts its second batch from rank 0's statistics (DDP's rule).
        ours, expected = got["stats"]
        torch.testing.assert_close(ours, expected)
