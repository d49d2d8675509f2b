"""What the image model files of the zoo share: a seeded image batch, BatchNorm's mode.

``ZOO_BN_EVAL=1`` puts every BatchNorm in eval mode (running statistics) when
the model is built: pipelined training with m micro-batches normalises each
micro-batch by its own statistics, so training-mode BatchNorm matches one
process only at m = 1; the parity tests set it, the plain runs do not.
"""

from __future__ import annotations

import os

import torch
from torch import nn

__all__ = ["CLASSES", "image_batch", "prepare"]

CLASSES = 10


def image_batch(batch_size: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(images (batch_size, 3, size, size), class labels (batch_size,))."""
    return torch.randn(batch_size, 3, size, size), torch.randint(0, CLASSES, (batch_size,))


def prepare(model: nn.Module) -> nn.Module:
    """The model, with BatchNorm in eval mode when ``ZOO_BN_EVAL=1``."""
    if os.environ.get("ZOO_BN_EVAL") == "1":
        for mod in model.modules():
            if isinstance(mod, nn.modules.batchnorm._BatchNorm):
                mod.eval()
    return model
