"""BERT (transformers) for sequence classification, fed a dict with an attention mask.

A small configuration, random weights, nothing downloaded; the last quarter of
every sequence is padding, masked out.
"""

from __future__ import annotations

import hf_common
import torch
import torchvision_cpu  # noqa: F401  (transformers imports torchvision when it is installed)
from transformers import BertConfig, BertForSequenceClassification

BATCH_SIZE = 8
LABELS = 4


def build_model():
    config = BertConfig(
        vocab_size=hf_common.VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=LABELS,
    )
    return BertForSequenceClassification(config)


def sample_batch(batch_size):
    ids, _ = hf_common.token_batch(batch_size)
    mask = torch.ones_like(ids)
    mask[:, -hf_common.SEQ // 4 :] = 0
    labels = torch.randint(0, LABELS, (batch_size,))
    return {"input_ids": ids, "attention_mask": mask}, labels


def loss_fn(outputs, targets):
    return torch.nn.functional.cross_entropy(outputs.logits, targets)
