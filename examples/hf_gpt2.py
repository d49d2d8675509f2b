"""GPT-2 from Hugging Face transformers, wrapped as a model file: how to bring a library model.

Three things make a library model a model file:

1. ``build_model()`` builds it from a config (random weights here; for a
   pretrained one, ``GPT2LMHeadModel.from_pretrained(...)`` inside it). For
   training, build it with ``use_cache=False``: a key/value cache in the output
   is for generation, and it is not a tensor the planner can trace.
2. ``sample_batch(batch_size)`` returns ``(inputs, targets)``: here a dict of
   keyword arguments for ``forward`` (``input_ids``), and next-token targets.
   It draws from torch's global RNG, so each training step (the runtime seeds
   it per step) sees another batch.
3. ``loss_fn(outputs, targets)`` receives exactly what the model returns (a
   ``CausalLMOutputWithCrossAttentions``), in ``planner profile``, ``plan`` and
   ``run`` alike, so ``outputs.logits`` (or ``outputs["logits"]``) works.

The LM head is tied to the token embedding (GPT-2's ``tie_word_embeddings``):
the first and the last stage each hold a copy, kept equal by the runtime.

Knobs (environment): ``HF_GPT2_LAYERS`` (default 4), ``HF_GPT2_DIM`` (default 128),
``HF_GPT2_SEQ`` (default 64), ``HF_GPT2_VOCAB`` (default 2048). Needs
``pip install transformers``.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

BATCH_SIZE = 8
LAYERS = int(os.environ.get("HF_GPT2_LAYERS", "4"))
DIM = int(os.environ.get("HF_GPT2_DIM", "128"))
SEQ = int(os.environ.get("HF_GPT2_SEQ", "64"))
VOCAB = int(os.environ.get("HF_GPT2_VOCAB", "2048"))


def build_model():
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=DIM,
        n_layer=LAYERS,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )
    return GPT2LMHeadModel(config)


def sample_batch(batch_size):
    ids = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    return {"input_ids": ids[:, :-1]}, ids[:, 1:]


def loss_fn(outputs, targets):
    logits = outputs.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
