"""A residual CNN whose channels grow with depth: a model file for the planner.

A 3×3 stem, then 4 stages of ``RESNET_BLOCKS`` basic blocks (two 3×3
conv-BN-ReLU with an identity shortcut). Each stage after the first halves the
resolution with a stride-2 conv and a 1×1 projection shortcut, and doubles the
channels (``width`` → 2× → 4× → 8×). Early stages hold big activations and few
parameters, late stages the reverse: the memory and compute of a split differ.
Global average pool and a linear classifier over 10 classes.

Knobs (keyword arguments of ``build_model``; their defaults come from the
environment, so ``RESNET_WIDTH=64 planner plan examples/resnet.py`` grows it):

``RESNET_WIDTH`` / ``width`` (default 32)     channels of the first stage
``RESNET_BLOCKS`` / ``blocks`` (default 2)    basic blocks per stage
``RESNET_RES`` / ``resolution`` (default 32)  input height and width; ``sample_batch``
    reads the same variable

Batches: images (B, 3, H, W) float; targets (B,) class ids (int64). No
``loss_fn``: the planner's default (cross-entropy for integer targets) applies.
"""

from __future__ import annotations

import os

import torch
from torch import nn

BATCH_SIZE = 32
N_CLASSES = 10


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer; set it to e.g. {default}") from None
    if value < 1:
        raise ValueError(f"{name}={value} must be a positive integer, e.g. {default}")
    return value


def _conv_bn(c_in: int, c_out: int, kernel: int, stride: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=False),
        nn.BatchNorm2d(c_out),
    )


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = _conv_bn(c_in, c_out, 3, stride)
        self.conv2 = _conv_bn(c_out, c_out, 3, 1)
        self.relu = nn.ReLU()
        # A 1×1 projection where the shape changes, the identity elsewhere.
        self.shortcut = (
            _conv_bn(c_in, c_out, 1, stride) if stride != 1 or c_in != c_out else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv2(self.relu(self.conv1(x)))
        return self.relu(y + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, width: int, blocks: int, n_classes: int = N_CLASSES) -> None:
        super().__init__()
        self.stem = nn.Sequential(_conv_bn(3, width, 3, 1), nn.ReLU())
        stages = []
        c_in = width
        for s in range(4):
            c_out = width * 2**s
            stage = [BasicBlock(c_in, c_out, 1 if s == 0 else 2)]
            stage += [BasicBlock(c_out, c_out, 1) for _ in range(1, blocks)]
            stages.append(nn.Sequential(*stage))
            c_in = c_out
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def build_model(*, width: int | None = None, blocks: int | None = None) -> ResNet:
    """The ResNet; each keyword left out is read from its environment variable or default."""
    width = _env_int("RESNET_WIDTH", 32) if width is None else width
    blocks = _env_int("RESNET_BLOCKS", 2) if blocks is None else blocks
    return ResNet(width, blocks)


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images and class ids: new each step (torch's seed), the global RNG untouched."""
    gen = torch.Generator().manual_seed(torch.initial_seed())  # planner run: seed + step
    res = _env_int("RESNET_RES", 32)
    x = torch.randn(batch_size, 3, res, res, generator=gen)
    y = torch.randint(0, N_CLASSES, (batch_size,), generator=gen)
    return x, y
