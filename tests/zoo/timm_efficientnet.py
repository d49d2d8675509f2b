"""EfficientNet-B0 (timm) at 64 × 64: in-place SiLU at block starts; random weights."""

from __future__ import annotations

import torchvision_cpu  # noqa: F401  (timm imports torchvision)

# isort: split
import timm
import vision_common

BATCH_SIZE = 8


def build_model():
    model = timm.create_model(
        "efficientnet_b0", pretrained=False, num_classes=vision_common.CLASSES, drop_rate=0.0
    )
    return vision_common.prepare(model)


def sample_batch(batch_size):
    return vision_common.image_batch(batch_size, 64)
