"""Small models the tests share, a snapshot of a model's whole state, and a test CPU
cluster with a chosen number of usable cores."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from planner.devices import Cluster, from_gpus
from planner.devices import cluster as cluster_module
from planner.devices.build import assemble
from planner.devices.catalogue import Device
from planner.options import PlanOptions, ProfileOptions, SearchOptions, Training
from planner.plan import Plan
from planner.plan.records import BlockCost, ModelProfile
from planner.planning import plan_model

__all__ = [
    "Net",
    "Tower",
    "assert_same_state",
    "block_cost",
    "chain_profiles",
    "cpu_cluster",
    "model_profile",
    "model_state",
    "tower_loss",
    "tower_plan",
    "usable_cores",
]


MB = 2**20


def block_cost(k: int, **fields: Any) -> BlockCost:
    """Block ``k`` of a test chain, ``b{k}`` (one module): 1 ms forward, 2 ms backward, and
    1 MiB each of parameters, saved activations, output and (after block 0) boundary, but
    for the ``fields`` given."""
    base: dict[str, Any] = {"name": f"b{k}", "modules": (f"b{k}",), "fwd_ms": 1.0}
    base |= {"bwd_ms": 2.0, "param_bytes": MB, "activation_bytes": MB, "output_bytes": MB}
    return BlockCost(index=k, **base | {"boundary_bytes": 0 if k == 0 else MB} | fields)


def model_profile(blocks: Sequence[BlockCost], device: str = "cpu", **fields: Any) -> ModelProfile:
    """A test profile of ``blocks`` at micro-batch 4, fp32: measured at 1 thread on the
    local CPU (``device`` "cpu"), else analytic for that catalogue device; but for the
    ``fields`` given."""
    cpu = device == "cpu"
    base: dict[str, Any] = {"fingerprint": "f", "device": device, "batch_size": 4}
    base |= {"source": "measured" if cpu else "analytic", "threads": 1 if cpu else 0}
    return ModelProfile(blocks=tuple(blocks), dtype="float32", capture="export", **base | fields)


def cpu_cluster(n: int, threads: int = 1) -> Cluster:
    """``n`` processes of a test CPU (1e11 FLOP/s, 20 GB/s), ``threads`` threads each."""
    cpu = Device(
        key="cpu",
        name="test CPU",
        kind="cpu",
        memory_bytes=64 * 2**30,
        peak_flops={"fp32": 1e11, "tf32": 1e11, "bf16": 1e11, "fp16": 1e11},
        memory_bandwidth=20e9,
        nvlink_bandwidth=0.0,
        pcie_bandwidth=20e9,
        compute_efficiency=1.0,
        memory_efficiency=1.0,
        op_overhead_s=1e-6,
        source="test",
    )
    return assemble(None, [[(cpu, threads)] * n], {})


@contextmanager
def usable_cores(n: int) -> Iterator[None]:
    """The cost model sees ``n`` usable cores on this machine."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cluster_module, "usable_cores", lambda: n)
        yield


class Net(nn.Module):
    """BatchNorm (running statistics), dropout (RNG) and a skip connection."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.5)
        self.mid = nn.Linear(32, 32)
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        y = self.mid(self.drop(torch.relu(self.bn(h))))
        return self.out(y + h)


class Tower(nn.Module):
    """An embedding, uneven layers and a tied head: the first and last stages are heavy."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(512, 64)
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(6))
        self.head = nn.Linear(64, 512, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for layer in self.layers:
            h = h + torch.relu(layer(h))
        return self.head(h)


def tower_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy for :class:`Tower`'s (batch, tokens, vocabulary) logits."""
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def tower_plan(
    devices: int = 4, *, cluster: Cluster | None = None, calibration: bool = True, **search: object
) -> Plan:
    """A :class:`Tower` planned on ``devices`` analytic H100s (or ``cluster``), batch 16
    (``calibration``: apply one stored for it, ``ProfileOptions.calibration``)."""
    torch.manual_seed(0)
    idx = torch.randint(0, 512, (16, 8))
    return plan_model(
        Tower(),
        (idx, idx),
        cluster=cluster or from_gpus(devices, "h100"),
        loss_fn=tower_loss,
        options=PlanOptions(
            training=Training(global_batch=16),
            search=SearchOptions(**search),  # type: ignore[arg-type]
            profile=ProfileOptions(repeats=1, warmup=0, calibration=calibration),
        ),
        model_file="tower.py",
    )


def model_state(model: nn.Module) -> dict[str, object]:
    """Everything profiling must leave as it found: tensors, grads, modes, flags, the RNG."""
    return {
        "tensors": {k: v.clone() for k, v in model.state_dict().items()},
        "grads": {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None},
        "training": [m.training for m in model.modules()],
        "requires_grad": [p.requires_grad for p in model.parameters()],
        "rng": torch.get_rng_state(),
    }


def assert_same_state(a: dict, b: dict) -> None:
    """Two :func:`model_state` snapshots are equal, bit for bit."""
    assert a["tensors"].keys() == b["tensors"].keys()
    for k, v in a["tensors"].items():
        assert torch.equal(v, b["tensors"][k]), k  # parameters and BN statistics
    assert a["grads"].keys() == b["grads"].keys()
    for k, g in a["grads"].items():
        assert torch.equal(g, b["grads"][k]), k
    assert a["training"] == b["training"] and a["requires_grad"] == b["requires_grad"]
    assert torch.equal(a["rng"], b["rng"])


def chain_profiles(n_blocks: int = 12, param_bytes: int = 64 * 2**20, heavy_ends: bool = True):
    """A search's ``profile_for(device, b)`` over a synthetic chain: ``n_blocks`` blocks of
    ``param_bytes`` parameters, 0.5 ms forward and 1 ms backward per sample, the first and
    last 4× that when ``heavy_ends``."""

    def profile_for(device: str, b: int) -> ModelProfile:
        blocks = []
        for k in range(n_blocks):
            scale = 4.0 if heavy_ends and k in (0, n_blocks - 1) else 1.0
            blocks.append(
                block_cost(
                    k,
                    name=f"layer{k}",
                    modules=(f"layer{k}",),
                    fwd_ms=0.5 * scale * b,
                    bwd_ms=1.0 * scale * b,
                    param_bytes=param_bytes,
                    activation_bytes=16 * MB * b,
                    output_bytes=MB * b,
                    boundary_bytes=0 if k == 0 else MB * b,
                )
            )
        return model_profile(
            blocks, device, fingerprint="x", source="analytic", batch_size=b, threads=0
        )

    return profile_for
