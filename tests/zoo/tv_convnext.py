"""ConvNeXt (torchvision's ConvNeXt class, a small stage setting) at 32 × 32.

Its blocks permute to channels-last for LayerNorm and back: tensors crossing a
split point need not be contiguous.
"""

from __future__ import annotations

import torchvision_cpu  # noqa: F401  (PyPI's torchvision beside a CPU torch)
import vision_common
from torchvision.models.convnext import CNBlockConfig, ConvNeXt

BATCH_SIZE = 8


def build_model():
    stages = [CNBlockConfig(24, 48, 2), CNBlockConfig(48, 96, 2), CNBlockConfig(96, None, 2)]
    model = ConvNeXt(stages, stochastic_depth_prob=0.0, num_classes=vision_common.CLASSES)
    return vision_common.prepare(model)


def sample_batch(batch_size):
    return vision_common.image_batch(batch_size, 32)
