"""The agreement on a step before any optimizer steps: [Note: the step's agreement].

Pure: no torch. Times in milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.cost.basis import CostBasis
from planner.devices.catalogue import Device

__all__ = ["AGREE_FIXED_MS", "NORM_OPS", "NORM_PASSES", "agree_ms"]

# [Note: the step's agreement] After its schedule and the tied exchange, every rank
# agrees on the step before any optimizer steps (runtime/engine.py,
# runtime/gradients.py): the loss is broadcast from the last stage over the pipeline
# and averaged over the replicas, and the global gradient norm (checked for NaN and
# infinities; clipped when asked) is summed over the pipeline's stages. So no
# stage's optimizer starts before every stage has finished its last backward (the
# step graph's tails wait for all of them: planner.cost.step_graph), and each rank
# first reads its gradients for the norm. On local CPUs ``_foreach_norm`` loops over
# the tensors: NORM_OPS dispatches a tensor and NORM_PASSES × the gradients' bytes at
# the memory bandwidth, after AGREE_FIXED_MS of checks (the losses stacked, scalars
# read back). Measured in the calibration benchmark's quiet run (2026-12-07) from a
# process's last backward to its optimizer step, one process alone (1×1, eight
# models): 0.35–2.2 ms, which a fit puts at 0.22 ms + 3.3 µs a tensor + 2.3 × the
# gradients' bytes at the copy bandwidth (the MLP 2.2 ms for 22 MiB of gradients in
# 10 tensors; BERT 0.38 ms, 44 tensors). On GPUs the fused ``_foreach_norm`` reads
# every gradient once at the memory bandwidth; the checks are not measured there (no
# GPU lent). The collectives carry a scalar each: what they cost is the wait for
# the other stages (the tails' edges); their latency is left out.
NORM_OPS = 3
NORM_PASSES = 2.0
AGREE_FIXED_MS = {"gloo": 0.2, "nccl": 0.0}


def agree_ms(
    b: CostBasis, s: int, blocks: tuple[int, int], devices: Sequence[Device], scale: float
) -> float:
    """The agreement of stage s holding ``blocks`` [i, j) (ms): the checks (every rank),
    and the read of its gradients for the global norm (with FSDP, a replica's shard) on the
    slowest of ``devices`` (its replicas'); local CPU work is slowed by ``scale`` (the
    steady state's time-slicing, ``StageTime.compute_scale``).

    Example: ``agree_ms(basis, 0, (0, 4), [cpu], 1.0)``.
    """
    i, j = blocks
    n_params = b.held_parameters(s, i, j) / (b.layout.dp if b.fsdp else 1)
    gloo = b.cluster.backend == "gloo"
    tensors = b.table(s).tensors[j] - b.table(s).tensors[i]
    slowest = 0.0
    for dev in devices:
        read = n_params * b.grads_b / (dev.memory_bandwidth * dev.memory_efficiency)
        t = tensors * NORM_OPS * dev.op_overhead_s + NORM_PASSES * read if gloo else read
        slowest = max(slowest, t)
    fixed = AGREE_FIXED_MS.get(b.cluster.backend, 0.0)
    return (fixed + slowest * 1e3) * (scale if gloo else 1.0)
