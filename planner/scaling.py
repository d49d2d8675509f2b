"""A profile at any micro-batch size, from profiles measured at one or two sizes.

Time of a block is close to affine in the micro-batch size ``b``: a fixed part
(operator launches, Python, weight-gradient reductions that do not shrink) and
a part proportional to ``b``. Two measured sizes give both:

    t(b) = t(b₁) + (t(b₂) − t(b₁)) · (b − b₁) / (b₂ − b₁),   clamped to ≥ 0

Activation, output and boundary bytes are exactly proportional to ``b`` (they
have a batch dimension), so they scale from the nearest measured size; the
parameters and buffers do not depend on ``b``. With one measured size, times
scale proportionally (no fixed part): the search profiles two sizes whenever it
needs more than one.

Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from planner.records import BlockCost, ModelProfile

__all__ = ["at_batch_size"]


def at_batch_size(profiles: Sequence[ModelProfile], batch_size: int) -> ModelProfile:
    """The profile at ``batch_size``, interpolated from ``profiles`` of one model.

    Example::

        p4 = at_batch_size([prof_2, prof_8], 4)

    Args:
        profiles: one or more profiles of the same model, device and options at
            different micro-batch sizes.
        batch_size: the micro-batch size wanted.
    """
    if not profiles:
        raise ValueError("need at least one measured profile")
    if batch_size < 1:
        raise ValueError(f"micro-batch size must be ≥ 1, got {batch_size}")
    for p in profiles:
        if p.batch_size == batch_size:
            return p
    first = profiles[0]
    for p in profiles[1:]:
        if p.fingerprint != first.fingerprint or len(p.blocks) != len(first.blocks):
            raise ValueError("profiles to interpolate must be of the same model and blocks")
    ordered = sorted(profiles, key=lambda p: p.batch_size)
    near = min(ordered, key=lambda p: (abs(p.batch_size - batch_size), p.batch_size))
    if len(ordered) == 1:
        lo = hi = ordered[0]
    else:
        # The two measured sizes around batch_size (or the two nearest, outside).
        below = [p for p in ordered if p.batch_size < batch_size]
        above = [p for p in ordered if p.batch_size > batch_size]
        if below and above:
            lo, hi = below[-1], above[0]
        elif above:
            lo, hi = above[0], above[1]
        else:
            lo, hi = below[-2], below[-1]

    def time(a: float, b: float) -> float:
        if lo is hi:
            return a * batch_size / lo.batch_size
        slope = (b - a) / (hi.batch_size - lo.batch_size)
        return max(0.0, a + slope * (batch_size - lo.batch_size))

    ratio = batch_size / near.batch_size
    blocks = []
    for bl, bh, bn in zip(lo.blocks, hi.blocks, near.blocks, strict=True):
        blocks.append(
            _scaled_block(bn, ratio, time(bl.fwd_ms, bh.fwd_ms), time(bl.bwd_ms, bh.bwd_ms))
        )
    whole_f = whole_b = None
    if lo.whole_fwd_ms is not None and hi.whole_fwd_ms is not None:
        whole_f = time(lo.whole_fwd_ms, hi.whole_fwd_ms)
    if lo.whole_bwd_ms is not None and hi.whole_bwd_ms is not None:
        whole_b = time(lo.whole_bwd_ms, hi.whole_bwd_ms)
    return replace(
        near,
        batch_size=batch_size,
        blocks=tuple(blocks),
        input_bytes=int(near.input_bytes * ratio),
        loss_fwd_ms=time(lo.loss_fwd_ms, hi.loss_fwd_ms),
        loss_bwd_ms=time(lo.loss_bwd_ms, hi.loss_bwd_ms),
        whole_fwd_ms=whole_f,
        whole_bwd_ms=whole_b,
        notes=(
            *near.notes,
            f"interpolated to micro-batch {batch_size} from "
            f"{sorted({lo.batch_size, hi.batch_size})}",
        ),
    )


def _scaled_block(b: BlockCost, ratio: float, fwd_ms: float, bwd_ms: float) -> BlockCost:
    return replace(
        b,
        fwd_ms=fwd_ms,
        bwd_ms=bwd_ms,
        activation_bytes=int(b.activation_bytes * ratio),
        output_bytes=int(b.output_bytes * ratio),
        boundary_bytes=int(b.boundary_bytes * ratio),
        fwd_flops=b.fwd_flops * ratio,
        bwd_flops=b.bwd_flops * ratio,
        fwd_bytes_moved=b.fwd_bytes_moved * ratio,
    )
