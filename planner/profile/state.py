"""Profiling leaves the model as it found it, and runs with a fixed number of threads."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["preserved", "threads_set"]


@contextmanager
def preserved(model: nn.Module) -> Iterator[None]:
    """Leave parameters, buffers, grads, modes and the RNG exactly as found."""
    training = [(m, m.training) for m in model.modules()]
    tensors = list(model.parameters()) + list(model.buffers())
    saved = [t.detach().clone() for t in tensors]
    grads = [p.grad for p in model.parameters()]
    requires = [p.requires_grad for p in model.parameters()]
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for t, s in zip(tensors, saved, strict=True):
                t.copy_(s)
        for p, g, r in zip(model.parameters(), grads, requires, strict=True):
            p.grad = g
            p.requires_grad_(r)
        for m, mode in training:
            m.training = mode
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


@contextmanager
def threads_set(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` inside the block, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
