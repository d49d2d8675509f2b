"""MobileNetV3-Small (torchvision) at 64 × 64: in-place hardswish at block starts."""

from __future__ import annotations

import torchvision_cpu  # noqa: F401  (PyPI's torchvision beside a CPU torch)
import vision_common
from torchvision.models import mobilenet_v3_small

BATCH_SIZE = 8


def build_model():
    model = mobilenet_v3_small(num_classes=vision_common.CLASSES, dropout=0.0)
    return vision_common.prepare(model)


def sample_batch(batch_size):
    return vision_common.image_batch(batch_size, 64)
