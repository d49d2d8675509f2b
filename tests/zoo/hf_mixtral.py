"""Mixtral (transformers): a sparse mixture of experts, top-2 of 4 experts per token.

A small configuration (``hf_common.causal_lm``), random weights, nothing downloaded.
The loss reads ``outputs["logits"]``: the model's own output, in planning and in training.
"""

from __future__ import annotations

import hf_common
import torchvision_cpu  # noqa: F401  (transformers imports torchvision when it is installed)
from transformers import MixtralConfig, MixtralForCausalLM

BATCH_SIZE = 8


def build_model():
    return hf_common.causal_lm(
        MixtralConfig,
        MixtralForCausalLM,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.0,
    )


def sample_batch(batch_size):
    return hf_common.token_batch(batch_size)


loss_fn = hf_common.causal_lm_loss
