"""ViT-Tiny (timm) at 32 × 32 with 8 × 8 patches and 3 blocks; random weights."""

from __future__ import annotations

import torchvision_cpu  # noqa: F401  (timm imports torchvision)

# isort: split
import timm
import vision_common

BATCH_SIZE = 8


def build_model():
    return timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=32,
        patch_size=8,
        depth=3,
        num_classes=vision_common.CLASSES,
    )


def sample_batch(batch_size):
    return vision_common.image_batch(batch_size, 32)
