"""A U-Net with long skip connections: a model file for the planner.

An encoder of ``depth`` levels (two 3×3 conv-BN-ReLU, then a 2×2 max-pool), a
bottleneck, and a decoder that upsamples with a 2×2 ``ConvTranspose2d``,
concatenates the encoder's feature map of the same level (the long skip) and
applies two conv-BN-ReLU; a 1×1 conv gives per-pixel logits over ``n_classes``.
The long skips stay alive across the whole middle of the network: a split there
sends them to the next stage along with the main path.

Knobs (keyword arguments of ``build_model``; their defaults come from the
environment, so ``UNET_DEPTH=4 planner plan examples/unet.py`` grows it):

``UNET_DEPTH`` / ``depth`` (default 3)        down levels (the input size must be
    divisible by 2**depth)
``UNET_WIDTH`` / ``width`` (default 16)       channels of the first level, doubled per level
``UNET_CLASSES`` / ``n_classes`` (default 4)  output classes; ``sample_batch`` reads it too
``UNET_RES`` / ``resolution`` (default 64)    input height and width; ``sample_batch``
    reads it

Batches: images (B, 3, H, W) float; targets (B, H, W) class ids (int64). No
``loss_fn``: the planner's default (cross-entropy over dim 1 for (B, C, H, W)
outputs and (B, H, W) targets) applies.
"""

from __future__ import annotations

import os

import torch
from torch import nn

BATCH_SIZE = 8


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


def _double_conv(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(),
        nn.Conv2d(c_out, c_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(),
    )


class Up(nn.Module):
    """Upsample ×2, concatenate the skip, two convs."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(c_in, c_out, 2, stride=2)
        self.conv = _double_conv(2 * c_out, c_out)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([self.up(x), skip], dim=1))


class UNet(nn.Module):
    def __init__(self, depth: int, width: int, n_classes: int) -> None:
        super().__init__()
        widths = [width * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList(
            _double_conv(3 if i == 0 else widths[i - 1], widths[i]) for i in range(depth)
        )
        self.pool = nn.MaxPool2d(2)
        self.bottleneck = _double_conv(widths[depth - 1], widths[depth])
        self.up = nn.ModuleList(Up(widths[i + 1], widths[i]) for i in reversed(range(depth)))
        self.head = nn.Conv2d(widths[0], n_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for down in self.down:
            x = down(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottleneck(x)
        for up, skip in zip(self.up, reversed(skips), strict=True):
            x = up(x, skip)
        return self.head(x)


def build_model(
    *, depth: int | None = None, width: int | None = None, n_classes: int | None = None
) -> UNet:
    """The U-Net; each keyword left out is read from its environment variable or default."""
    depth = _env_int("UNET_DEPTH", 3) if depth is None else depth
    width = _env_int("UNET_WIDTH", 16) if width is None else width
    n_classes = _env_int("UNET_CLASSES", 4) if n_classes is None else n_classes
    return UNet(depth, width, n_classes)


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images and per-pixel class ids: new each step (torch's seed), RNG untouched."""
    gen = torch.Generator().manual_seed(torch.initial_seed())  # planner run: seed + step
    res = _env_int("UNET_RES", 64)
    depth = _env_int("UNET_DEPTH", 3)
    if res % 2**depth:
        raise ValueError(f"UNET_RES={res} must be divisible by 2**UNET_DEPTH={2**depth}")
    x = torch.randn(batch_size, 3, res, res, generator=gen)
    y = torch.randint(0, _env_int("UNET_CLASSES", 4), (batch_size, res, res), generator=gen)
    return x, y
