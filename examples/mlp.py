"""An MLP classifier with uneven layer widths: a model file for the planner.

Layers 512 → 2048 → 256 → 1024 → 128 → 10 (ReLU between them), so some blocks
cost far more than others and an even split by layer count is a bad split.

Knobs (keyword arguments of ``build_model``; their defaults come from the
environment, so ``MLP_SCALE=4 planner plan examples/mlp.py`` grows the model):

``MLP_SCALE`` / ``scale`` (default 1)
    Multiplies every hidden width (the input and the 10 classes stay).
``MLP_IN`` / ``in_features`` (default 512)
    Input features; ``sample_batch`` reads the same variable.

Batches: ``x`` of shape (B, MLP_IN), float; targets (B,) class ids (int64), the argmax of
a fixed random linear map of ``x`` (a task the MLP can learn).
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
    """Random features, labelled by a fixed random linear teacher: new data each step, learnable.

    The features come from a generator seeded with torch's seed (``planner run``
    sets it to seed + step), so the global RNG is untouched; the teacher is the
    same in every call, so a run learns it and its loss falls.
    """
    n_in = _env_int("MLP_IN", 512)
    x = torch.randn(batch_size, n_in, generator=torch.Generator().manual_seed(torch.initial_seed()))
    teacher = torch.randn(n_in, N_CLASSES, generator=torch.Generator().manual_seed(0))
    return x, (x @ teacher).argmax(dim=1)
