"""ResNet-50 (torchvision) at 64 × 64: Bottleneck blocks whose residual is an in-place add."""

from __future__ import annotations

import torchvision_cpu  # noqa: F401  (PyPI's torchvision beside a CPU torch)
import vision_common
from torchvision.models import resnet50

BATCH_SIZE = 8


def build_model():
    return vision_common.prepare(resnet50(num_classes=vision_common.CLASSES))


def sample_batch(batch_size):
    return vision_common.image_batch(batch_size, 64)
