"""Llama (transformers): RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

A small configuration (``hf_common.causal_lm``), random weights, nothing downloaded.
The loss reads ``outputs["logits"]``: the model's own output, in planning and in training.
"""

from __future__ import annotations

import hf_common
import torchvision_cpu  # noqa: F401  (transformers imports torchvision when it is installed)
from transformers import LlamaConfig, LlamaForCausalLM

BATCH_SIZE = 8


def build_model():
    return hf_common.causal_lm(LlamaConfig, LlamaForCausalLM)


def sample_batch(batch_size):
    return hf_common.token_batch(batch_size)


loss_fn = hf_common.causal_lm_loss
