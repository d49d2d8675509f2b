"""Small configurations of the bundled examples (and one export refuses), for runtime tests."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from repo import EXAMPLES
from torch import nn

from planner.plan.modelfile import load_model_file

__all__ = ["Branchy", "batch", "build", "example_module", "loss_for"]


@torch.fx.wrap
def _gate(x: torch.Tensor) -> torch.Tensor:
    # Data-dependent Python control flow: torch.export refuses it; symbolic_trace keeps the
    # wrapped function as one call, run eagerly. (Always true for finite x, so a
    # micro-batch takes the same branch as the whole batch.)
    return x * 2.0 if bool(torch.isfinite(x).all()) else x


class Branchy(nn.Module):
    """A model pipeline() (torch.export) cannot split: the runtime must fall back to fx."""

    def __init__(self) -> None:
        super().__init__()
        self.fc0 = nn.Linear(32, 64)
        self.fc1 = nn.Linear(64, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _gate(self.fc1(torch.relu(self.fc0(x))))
        return self.fc2(torch.relu(h))


def example_module(name: str) -> Any:
    """The bundled example ``name`` (examples/NAME.py), loaded as a model file."""
    return load_model_file(EXAMPLES / f"{name}.py").module


def build(name: str) -> nn.Module:
    """A small configuration of the example ``name`` (or ``Branchy``)."""
    if name == "branchy":
        return Branchy()
    mod = example_module(name)
    if name == "unet":
        return mod.build_model(depth=2, width=4, n_classes=4)
    if name == "mlp":
        return mod.build_model(in_features=32)
    if name == "resnet":
        return mod.build_model(width=4, blocks=1)
    # No biases: the key projection's bias has an exactly-zero true gradient (softmax is
    # shift-invariant), so Adam would turn rounding noise into full-size, unequal updates.
    return mod.build_model(
        n_layers=2, dim=64, n_heads=4, seq_len=16, vocab_size=512, dropout=0.0, bias=False
    )


def batch(name: str, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of ``size`` for the model ``name``, the same for the same seed."""
    gen = torch.Generator().manual_seed(1000 + seed)
    if name in ("mlp", "branchy"):
        return torch.randn(size, 32, generator=gen), torch.randint(0, 10, (size,), generator=gen)
    if name == "unet":
        x = torch.randn(size, 3, 8, 8, generator=gen)
        return x, torch.randint(0, 4, (size, 8, 8), generator=gen)
    if name == "resnet":
        x = torch.randn(size, 3, 8, 8, generator=gen)
        return x, torch.randint(0, 10, (size,), generator=gen)
    tokens = torch.randint(0, 512, (size, 17), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_for(name: str) -> Any:
    """The loss of the model ``name``."""
    return example_module("gpt").loss_fn if name == "gpt" else F.cross_entropy
