"""The GPT example at GPT-3 6.7B's shape: a model too big for one GPU, to plan on catalogue GPUs.

32 pre-norm blocks of width 4096 with 32 heads, a 2048-token context and a
50 304-token vocabulary (GPT-2's 50 257, padded to a multiple of 64): 6.7 B
parameters, the tied embedding and LM head included (``examples/gpt.py`` is the
model; this file only fixes its shape and the batch).

With Adam its weights, gradients and optimizer state alone take about 108 GiB,
more than an 80 GB H100 holds, so a plan on H100s must pipeline::

    planner plan examples/gpt_6b.py --gpus 8 --device-type h100 --precision bf16-mixed

Planning for a catalogue GPU needs shapes only: the planner builds the model on
the meta device and allocates none of its 27 GB of fp32 weights. Running it
needs the GPUs it was planned for (``planner run`` on this machine's CPU would
build the whole model in memory).
"""

from __future__ import annotations

import torch
from gpt import GPT, GPTConfig, loss_fn  # the neighbouring example (its folder is on sys.path)

__all__ = ["BATCH_SIZE", "CONFIG", "build_model", "loss_fn", "sample_batch"]

BATCH_SIZE = 64
CONFIG = GPTConfig(vocab_size=50304, seq_len=2048, dim=4096, n_heads=32, n_layers=32)


def build_model() -> GPT:
    return GPT(CONFIG)


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and their next tokens: new each step (torch's seed), RNG untouched."""
    gen = torch.Generator().manual_seed(torch.initial_seed())
    tokens = torch.randint(0, CONFIG.vocab_size, (batch_size, CONFIG.seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
