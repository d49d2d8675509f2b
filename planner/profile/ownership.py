"""What each block owns: its parameters and buffers, and the bytes its backward keeps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch import nn

from planner.capture.blocks import BlockChain
from planner.profile.runner import BlockRunner, attr, storage_key

__all__ = ["Owners", "param_nbytes", "saved_bytes"]


class Owners:
    """Which block owns each parameter/buffer (the first block that uses it)."""

    def __init__(self, chain: BlockChain) -> None:
        self.chain = chain
        self.first: dict[str, int] = {}
        self.target_of: dict[str, str] = {}
        for block in chain.blocks:
            for target in block.params:
                canon = chain.param_owner.get(target, target)
                self.first.setdefault(canon, block.index)
                self.target_of.setdefault(canon, target)

    def _sizes(self, k: int, gm: torch.fx.GraphModule, params: bool) -> list[int]:
        """Bytes of each parameter (or buffer) block k owns."""
        sizes = []
        for canon, first in self.first.items():
            if first != k:
                continue
            t = attr(gm, self.target_of[canon])
            if isinstance(t, torch.Tensor) and isinstance(t, nn.Parameter) == params:
                sizes.append(t.numel() * t.element_size())
        return sizes

    def param_fields(self, k: int, gm: torch.fx.GraphModule, scale: float) -> dict[str, Any]:
        """``BlockCost``'s ``param_bytes`` and ``param_tensors`` of block k, scaled."""
        sizes = self._sizes(k, gm, params=True)
        tensors = tuple(sorted((int(x * scale) for x in sizes), reverse=True))
        return {"param_bytes": int(sum(sizes) * scale), "param_tensors": tensors}

    def buffer_bytes(self, k: int, gm: torch.fx.GraphModule) -> int:
        return sum(self._sizes(k, gm, params=False))


def param_nbytes(name: str, model: nn.Module) -> int:
    """Bytes of the parameter or buffer called ``name`` (0 when there is none)."""
    named: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    t = named.get(name)
    return int(t.numel() * t.element_size()) if t is not None else 0


def saved_bytes(
    chain: BlockChain, runners: Sequence[BlockRunner], values: dict[torch.fx.Node, Any]
) -> list[int]:
    """Per block, the bytes the backward keeps that the block created.

    A block's own saved storages, plus its outputs that later blocks save (and
    it did not): see [Note: saved bytes, each tensor once] in planner.profile.runner.
    Model inputs saved by a block are charged to no block: they are the batch,
    which the caller holds anyway; nor are views of them, of weights or of buffers
    that a block makes (BERT's position ids, a slice of a buffer: 768 bytes a
    micro-batch were charged to its first block).
    """
    held = {  # storages that exist whatever the blocks save
        storage_key(v)
        for n, v in values.items()
        if n.op in ("placeholder", "get_attr") and isinstance(v, torch.Tensor)
    }
    producer: dict[torch.fx.Node, int] = {}
    for block in chain.blocks:
        for node in block.nodes:
            producer[node] = block.index
    out = [r.saved_bytes for r in runners]
    charged: set[int] = set()
    for block, runner in zip(chain.blocks, runners, strict=True):
        for k in sorted(runner.saved_inputs):
            node = block.inputs[k]
            value = values.get(node)
            p = producer.get(node)
            if p is None or not isinstance(value, torch.Tensor):
                continue
            src = chain.blocks[p]
            if node in src.outputs and src.outputs.index(node) in runners[p].saved_outputs:
                continue  # the producer saved it itself: already in its figure
            key = storage_key(value)  # not data_ptr(): it is 0 for every meta tensor
            if key not in charged and key not in held:
                charged.add(key)
                out[p] += value.untyped_storage().nbytes()
    return out
