"""The optimizer step of a local CPU process: [Note: the CPU optimizer step].

Pure: no torch. Times in seconds.
"""

from __future__ import annotations

import math

from planner.cost.basis import CostBasis
from planner.devices.catalogue import Device

__all__ = ["CPU_STEP", "cpu_step_s"]

# [Note: the CPU optimizer step] On CPU torch steps one parameter tensor at a
# time (the foreach path is the default on GPUs only): per tensor a run of small
# ops, each costing a dispatch (the device's measured ``op_overhead_s``; Adam 19
# ops, 21 µs per tensor here, measured), and per parameter the traffic of those
# ops: Adam reads and writes 18 fp32 values (the moments' updates, sqrt,
# division, the addcdiv into the weights: 72 B), AdamW one more pass for the
# decay, SGD with momentum 8 (32 B). Where that traffic goes depends on the
# tensor's size, not on the process's threads (the bandwidths are measured at the
# process's thread count already: dividing by it again priced examples/mlp.py's
# step at 6.4 ms, measured 12-17):
#
# * a tensor whose working set (weights, gradient, state and one temporary) fits
#   in the process's share of the CPU's largest cache (``Device.cache_bytes`` over
#   the processes on the node) comes from memory once, 28 B per parameter for
#   Adam (20 for SGD: weights and state read and written, gradient read), and its
#   ops then run at the cache's bandwidth (``Device.cache_bandwidth``);
# * a larger one streams every op's 72 B from memory (``memory_bandwidth``).
#
# Against the optimizer steps measured in python -m bench accuracy (2-core
# machine, 32 MiB cache; memory 25 GB/s at 1 thread, 34 at 2; cache 85 and 150),
# predicted / measured ms, one stage's step alone: MLP (tensors of 2.1 M, 1 M,
# 0.5 M parameters) 12.4 / 12.2 at 2 threads; at pp 2, 1 thread each, its stages
# 12.6 / 12.0, 4.4 / 4.3, 6.3 / 6.6, 10.7 / 13.6; ResNet's and U-Net's (many
# small tensors) within 0.5 ms of 1-3 ms; GPT (a 2.1 M embedding, 3.2 M in
# tensors of 0.26 M and less) 10.5 / 7.3 at 2 threads: its small tensors step
# faster than "once from memory, then in cache" says. The model before this one
# (all traffic at memory bandwidth, divided by the threads) had MLP at 6.4 /
# 12-17 and its pp 2 stages at 1.1-1.9 times their measured steps.
CPU_STEP = {"adam": (19, 72.0, 28.0), "adamw": (21, 80.0, 28.0), "sgd": (6, 32.0, 20.0)}
"""Per optimizer: (ops per tensor, bytes per parameter its ops move, bytes per
parameter a tensor that stays in cache brings from memory once)."""


def cpu_step_s(
    b: CostBasis, s: int, blocks: tuple[int, int], dev: Device, n_params: float, processes: int
) -> float:
    """The step of ``n_params`` parameters of stage s's blocks [i, j) (tied copies
    included; ZeRO-1's share or FSDP's shard of them) on ``dev``, alone, in seconds;
    ``processes`` share the node's cache.

    Example: ``cpu_step_s(basis, 0, (0, 4), cpu, basis.stepped(0, 0, 4), 2)``.
    """
    i, j = blocks
    tab = b.table(s)
    ops, per_param, once = CPU_STEP[b.training.optimizer]
    copies = b.tied_copy_bytes(i, j)
    tensors = tab.tensors[j] - tab.tensors[i] + (1 if copies else 0)
    if b.sharded:  # ZeRO-1: whole tensors, at most ⌈tensors / dp⌉ each (FSDP: all)
        tensors = math.ceil(tensors / b.layout.dp)
    # Tensors (profile bytes) larger than this spill the process's share of the cache.
    touched = b.weights_b + b.grads_b + b.optim_b + 4  # bytes per parameter, a temporary
    share = dev.cache_bytes / max(1, processes) if dev.cache_bandwidth else 0.0
    size = share / touched * b.param_elem
    beyond = tab.beyond(size)
    spilled = beyond[j] - beyond[i] + (copies if copies > size else 0.0)
    held = b.held_parameters(s, i, j)
    part = n_params / held if held else 0.0  # ZeRO-1, FSDP: a part of them
    big = spilled / b.param_elem * part
    small = n_params - big
    memory = dev.memory_bandwidth * dev.memory_efficiency
    t = big * per_param / memory + tensors * ops * dev.op_overhead_s
    if small > 0:
        t += small * (once / memory + per_param / dev.cache_bandwidth)
    return t
