"""The zero-bubble schedules' gradient average by hand (runtime/zero_bubble.py), on 2 processes.

A stage that averages its gradients itself ([Note: DDP under a split
backward]) must send what DDP would send: bf16 on the wire under bf16-mixed
(what the cost model prices), fp32 otherwise. The values tell the two apart:
rank 0's gradient is 1 + 2⁻¹⁰, rank 1's is 1. In fp32 their mean is
1 + 2⁻¹¹; in bf16 (8 significant bits) 1 + 2⁻¹⁰ rounds to 1, so the mean
is exactly 1. The average runs after the stage's last weights' backward
only, and only for the schedules and dp modes that need it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from world import run_world

from runtime.zero_bubble import reduce_by_hand, reduces_by_hand

pytestmark = pytest.mark.multiprocess

ODD = 1 + 2**-10


class _Stage:
    """The two methods of torch's pipeline stage that the average wraps; each sets the grads."""

    def __init__(self, module: nn.Module, value: float) -> None:
        self.module, self.value = module, value

    def _set(self) -> None:
        for p in self.module.parameters():
            p.grad = torch.full_like(p, self.value)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        self._set()

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> None:  # fmt: skip
        self._set()


def _worker() -> dict[str, list[float]]:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = SimpleNamespace(dp=2, dp_group=dist.group.WORLD)
    value = ODD if rank == 0 else 1.0
    out: dict[str, list[float]] = {}
    for precision in ("fp32", "bf16-mixed"):
        plan = SimpleNamespace(schedule="zbv", dp_mode="ddp", precision=precision)
        module = nn.Linear(3, 2)
        stage = _Stage(module, value)
        reduce_by_hand(stage, module, mesh, plan)  # type: ignore[arg-type]
        stage.backward_weight_one_chunk(0)  # not the last: no average
        out[f"{precision}-early"] = [float(module.weight.grad[0, 0])]
        stage.backward_weight_one_chunk(1, last_backward=True)
        out[precision] = [float(p.grad.reshape(-1)[0]) for p in module.parameters()]
        stage.backward_one_chunk(2, last_backward=True, full_backward=False)  # I alone: none
        out[f"{precision}-input"] = [float(module.weight.grad[0, 0])]
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def world() -> list[dict[str, list[float]]]:
    return run_world(_worker, 2, timeout_s=60)


def test_the_average_runs_in_fp32_under_fp32_and_in_bf16_under_bf16_mixed(
    world: list[dict[str, list[float]]],
) -> None:
    for rank in world:
        assert rank["fp32"] == [(ODD + 1) / 2] * 2, rank  # weight and bias
        assert rank["bf16-mixed"] == [1.0, 1.0], rank  # 1 + 2⁻¹⁰ rounded to bf16 on the wire


def test_the_average_waits_for_the_last_weights_backward(
    world: list[dict[str, list[float]]],
) -> None:
    for rank, own in zip(world, (ODD, 1.0), strict=True):
        assert rank["fp32-early"] == [own] and rank["bf16-mixed-early"] == [own], rank
        assert rank["fp32-input"] == [own], rank  # an input-only pass leaves the grads alone


def test_only_a_split_backward_with_ddp_or_zero1_over_replicas_averages_by_hand() -> None:
    def plan(schedule: str, mode: str) -> Any:
        return SimpleNamespace(schedule=schedule, dp_mode=mode)

    assert reduces_by_hand(plan("zbv", "ddp"), 2) and reduces_by_hand(plan("dualpipev", "zero1"), 4)
    assert reduces_by_hand(plan("interleaved-zb", "ddp"), 2)
    assert not reduces_by_hand(plan("zbv", "fsdp"), 2)  # torch reduce-scatters
    assert not reduces_by_hand(plan("zbv", "ddp"), 1)  # no replicas
    assert not reduces_by_hand(plan("interleaved-1f1b", "ddp"), 2)  # DDP sees every gradient
