"""ViT (transformers) for image classification: a small configuration, random weights."""

from __future__ import annotations

import torch
import torchvision_cpu  # noqa: F401  (transformers imports torchvision when it is installed)
from transformers import ViTConfig, ViTForImageClassification

BATCH_SIZE = 8
CLASSES = 10


def build_model():
    config = ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=CLASSES,
    )
    return ViTForImageClassification(config)


def sample_batch(batch_size):
    return torch.randn(batch_size, 3, 32, 32), torch.randint(0, CLASSES, (batch_size,))


def loss_fn(outputs, targets):
    return torch.nn.functional.cross_entropy(outputs.logits, targets)
