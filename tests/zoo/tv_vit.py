"""ViT-B/16's architecture (torchvision's VisionTransformer) at 64 × 64, 2 layers of width 96.

torch's MultiheadAttention inside: the residual stream it returns is a
transposed view, so tensors crossing a split point need not be contiguous.
"""

from __future__ import annotations

import torchvision_cpu  # noqa: F401  (PyPI's torchvision beside a CPU torch)
import vision_common
from torchvision.models.vision_transformer import VisionTransformer

BATCH_SIZE = 8


def build_model():
    return VisionTransformer(
        image_size=64,
        patch_size=16,
        num_layers=2,
        num_heads=4,
        hidden_dim=96,
        mlp_dim=192,
        num_classes=vision_common.CLASSES,
    )


def sample_batch(batch_size):
    return vision_common.image_batch(batch_size, 64)
