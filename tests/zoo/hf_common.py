"""What the transformers model files of the zoo share: a seeded batch of token ids, the LM loss.

Batches draw from torch's global RNG, as a training script's data would: the
runtime seeds it per step, so every step sees another batch, and the planner
seeds it before it asks for one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SEQ", "VOCAB", "causal_lm", "causal_lm_loss", "token_batch"]

SEQ = 32
VOCAB = 512


def token_batch(
    batch_size: int, seq: int = SEQ, vocab: int = VOCAB
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, next-token targets), both (batch_size, seq) int64."""
    ids = torch.randint(0, vocab, (batch_size, seq + 1))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def causal_lm_loss(outputs, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a causal LM's ``outputs["logits"]`` (a ModelOutput) against the targets."""
    logits = outputs["logits"]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def causal_lm(config_cls: Any, model_cls: Any, **extra: Any) -> nn.Module:
    """A small causal LM of a transformers family (Llama's config fields), for training.

    Two layers of width 64, grouped-query attention (4 heads, 2 key/value heads),
    no dropout, no key/value cache in the output, untied head; ``extra``
    config fields on top (a mixture of experts' router, say).
    """
    config = config_cls(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_dropout=0.0,
        use_cache=False,  # training: no key/value cache in the outputs
        tie_word_embeddings=False,
        **extra,
    )
    return model_cls(config)
