"""An MLP classifier with uneven layer widths: a model file for the planner.

Layers 512 → 2048 → 256 → 1024 → 128 → 10 (ReLU between them), so some blocks
cost far more than others and an even split by layer count is a bad split.

Knobs (keyword arguments of ``build_model``; their defaults come from the
environment, so ``MLP_SCALE=4 planner plan examples/mlp.py`` grows the model):

``MLP_SCALE`` / ``scale`` (default 1)
    Multiplies every hidden width (the input and the 10 classes stay).
``MLP_IN`` / ``in_features`` (default 512)
    Input features; ``sample_batch`` reads the same variable.

Batches: ``x`` of shape (B, MLP_IN), float; targets (B,) class ids (int64).
No ``loss_fn``: the planner's default (cross-entropy for integer targets) applies.
"""

from __future__ import annotations

import itertools
import os
from collections import OrderedDict

import torch
from torch import nn

BATCH_SIZE = 64
N_CLASSES = 10
HIDDEN = (2048, 256, 1024, 128)


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


def build_model(*, scale: int | None = None, in_features: int | None = None) -> nn.Module:
    """The MLP: ``nn.Sequential`` of named ``fc``/``act`` layers, widths times ``scale``."""
    scale = _env_int("MLP_SCALE", 1) if scale is None else scale
    in_features = _env_int("MLP_IN", 512) if in_features is None else in_features
    widths = (in_features, *(w * scale for w in HIDDEN), N_CLASSES)
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    for i, (n_in, n_out) in enumerate(itertools.pairwise(widths)):
        layers[f"fc{i}"] = nn.Linear(n_in, n_out)
        if i < len(widths) - 2:
            layers[f"act{i}"] = nn.ReLU()
    return nn.Sequential(layers)


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random features and class ids: new each step (torch's seed), the global RNG untouched."""
    gen = torch.Generator().manual_seed(torch.initial_seed())  # planner run: seed + step
    x = torch.randn(batch_size, _env_int("MLP_IN", 512), generator=gen)
    y = torch.randint(0, N_CLASSES, (batch_size,), generator=gen)
    return x, y
