"""A profile at any micro-batch size, from profiles measured at one or two sizes.

:class:`SizedProfiles` is what the search asks: the profile of a device type
at a micro-batch size, measured (or priced) at the largest and smallest sizes
the search needs, the rest interpolated by :func:`at_batch_size`.

Time of a block is close to affine in the micro-batch size ``b``: a fixed part
(operator launches, Python, weight-gradient reductions that do not shrink) and
a part proportional to ``b``. Two measured sizes give both:

    t(b) = t(b₁) + (t(b₂) − t(b₁)) · (b − b₁) / (b₂ − b₁),   clamped to ≥ 0

Activation, output and boundary bytes are exactly proportional to ``b`` (they
have a batch dimension), so they scale from the nearest measured size; the
parameters and buffers do not depend on ``b``. With one measured size, times
scale proportionally (no fixed part): the search profiles two sizes whenever it
needs more than one.

"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from planner.cache import load_calibration
from planner.capture.trace import CaptureError
from planner.devices.cluster import Cluster
from planner.options import ProfileOptions, Training
from planner.plan.calibration import calibrated
from planner.plan.records import BlockCost, ModelProfile
from planner.plan.text import first_line
from planner.profile.meta import sampled_on_meta
from planner.profile.profiler import profile_model
from planner.profile.timing import Progress

__all__ = ["Sampler", "SizedProfiles", "at_batch_size"]

Sampler = Callable[[int], tuple[tuple[Any, ...], dict[str, Any], Any]]
"""sampler(batch_size) -> (args, kwargs, targets) of one micro-batch."""


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
    check = None
    if lo.split_check and hi.split_check and near.split_check:
        check = replace(
            near.split_check,
            blocks_ms=time(lo.split_check.blocks_ms, hi.split_check.blocks_ms),
            whole_ms=time(lo.split_check.whole_ms, hi.split_check.whole_ms),
        )
    return replace(
        near,
        batch_size=batch_size,
        blocks=tuple(blocks),
        input_bytes=int(near.input_bytes * ratio),
        target_bytes=int(near.target_bytes * ratio),
        loss_fwd_ms=time(lo.loss_fwd_ms, hi.loss_fwd_ms),
        loss_bwd_ms=time(lo.loss_bwd_ms, hi.loss_bwd_ms),
        whole_fwd_ms=whole_f,
        whole_bwd_ms=whole_b,
        split_check=check,
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
        boundary_copy_bytes=int(b.boundary_copy_bytes * ratio),
        boundary_grad_bytes=None
        if b.boundary_grad_bytes is None
        else int(b.boundary_grad_bytes * ratio),
        fwd_flops=b.fwd_flops * ratio,
        bwd_flops=b.bwd_flops * ratio,
        fwd_bytes_moved=b.fwd_bytes_moved * ratio,
    )


class SizedProfiles:
    """Profiles per (device type, micro-batch size): two measured anchors, the rest scaled.

    All profiles share the chain of the first one (same split points), so the
    blocks mean the same thing at every size and on every device.

    Args:
        model, sampler, loss_fn: what to profile, on which batches, with which loss.
        cluster: the devices: a local CPU cluster is measured here (with each
            process's threads), a catalogue GPU priced.
        training: bf16-mixed prices activations and FLOPs as bf16.
        options: repeats, warm-up, granularity, cache.
        sizes: every micro-batch size the search may need.
        progress: progress callback.
    """

    def __init__(
        self,
        model: nn.Module,
        sampler: Sampler,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        cluster: Cluster,
        training: Training,
        options: ProfileOptions,
        sizes: Sequence[int],
        progress: Progress | None = None,
    ) -> None:
        self.model = model
        self.sampler = sampler
        self.loss_fn = loss_fn
        self.cluster = cluster
        self.training = training
        self.options = options
        self.progress = progress
        self.sizes = sorted(sizes)
        self.anchors: dict[tuple[str, int], list[ModelProfile]] = {}  # (device, threads)
        self.split_points: tuple[str, ...] | None = options.split_points
        self.cache: dict[tuple[str, int, int], ModelProfile] = {}

    def _threads(self, threads: int | None) -> int:
        """The torch threads a local CPU profile is measured with (0: not a local CPU)."""
        if self.cluster.backend != "gloo":
            return 0
        return threads or self.cluster.devices[0].threads

    def _profile(self, device: str, b: int, threads: int) -> ModelProfile:
        local = device == "cpu"
        bf16 = self.training.precision == "bf16-mixed"
        opts = dataclasses.replace(
            self.options,
            device="local" if local else device,
            dtype=None if local else ("bf16" if bf16 else None),
            threads=(threads if local else None) or self.options.threads,
            split_points=self.split_points,
        )

        def run(batch: tuple[tuple[Any, ...], dict[str, Any], Any]) -> ModelProfile:
            args, kwargs, targets = batch
            return profile_model(
                self.model,
                args,
                kwargs,
                targets=targets,
                loss_fn=self.loss_fn,
                options=opts,
                progress=progress,
            )

        progress = self._phases(device, b, threads)
        try:
            # An analytic profile needs shapes only: the batch is drawn on the meta device.
            prof = run(self.sampler(b)) if local else sampled_on_meta(self.sampler, b, run)
        except CaptureError as exc:
            if b == max(self.sizes):
                raise
            raise self._too_small(b, exc) from exc
        if self.split_points is None:
            self.split_points = tuple(b.name for b in prof.blocks)
        return self._calibrated(prof)

    def _calibrated(self, prof: ModelProfile) -> ModelProfile:
        """``prof`` with the calibration stored for it applied (``planner calibrate``),
        unless ``--no-calibration``."""
        if not self.options.calibration:
            return prof
        precision = self.training.precision
        cal = load_calibration(prof.fingerprint, prof.device, prof.threads, precision)
        return prof if cal is None else calibrated(prof, cal)

    def _phases(self, device: str, b: int, threads: int) -> Progress | None:
        """The progress callback for one anchor's profile: a phase "tracing" begun now
        (until the timing starts, or the priced profile is done), and the timing's phases
        named after the anchor ("timing 37 blocks at micro-batch 8 (1 of 2)")."""
        report = self.progress
        if report is None:
            return None
        anchors = self.anchor_sizes()
        at = f"micro-batch {b}"
        if b in anchors and len(anchors) > 1:
            at += f" ({anchors.index(b) + 1} of {len(anchors)})"
        plural = "s" if threads != 1 else ""
        at += f", {threads} thread{plural}" if device == "cpu" and threads else f" for {device}"
        first = "tracing" if device == "cpu" else "tracing and pricing"
        report(f"{first} the model at {at}", 0, 0, "")

        def labelled(phase: str, done: int, total: int, note: str) -> None:
            report(f"{phase} at {at}", done, total, note)

        return labelled

    def _too_small(self, b: int, exc: CaptureError) -> ValueError:
        """The model runs at the largest micro-batch but not at ``b`` (e.g. BatchNorm1d at 1)."""
        batch = self.training.global_batch
        least = min(size for size in self.sizes if size > b)
        m = max(k for k in range(1, batch + 1) if batch % k == 0 and batch // k >= least)
        cause = exc.__cause__ or exc
        return ValueError(
            f"the model does not run on a micro-batch of {b} sample(s): "
            f"{type(cause).__name__}: {first_line(cause)}\n"
            f"  why: the search tries every micro-batch count m that divides the batch, so "
            f"micro-batches of {batch} / (dp × m) = {', '.join(map(str, self.sizes))} "
            f"samples; the model runs on {max(self.sizes)}, not on {b}.\n"
            f"  fix: pin --micro-batches (and --dp) so that each micro-batch holds at least "
            f"{least} samples, e.g. --dp 1 --micro-batches {m}; or "
            "make the model run on smaller batches (e.g. LayerNorm or GroupNorm instead of "
            "BatchNorm1d)"
        )

    def first(self) -> ModelProfile:
        """The first device type's profile at the largest size (it fixes the chain)."""
        return self.get(self.cluster.device_types[0], max(self.sizes))

    def anchor_sizes(self) -> list[int]:
        lo, hi = min(self.sizes), max(self.sizes)
        return [hi] if lo == hi else [hi, lo]

    def get(self, device: str, b: int, threads: int | None = None) -> ModelProfile:
        """The profile of ``device`` at micro-batch ``b`` (what the search asks); on a local
        CPU measured with ``threads`` torch threads (None: the cluster's)."""
        t = self._threads(threads)
        if (device, b, t) in self.cache:
            return self.cache[(device, b, t)]
        if (device, t) not in self.anchors:
            self.anchors[(device, t)] = [self._profile(device, a, t) for a in self.anchor_sizes()]
        prof = at_batch_size(self.anchors[(device, t)], b)
        self.cache[(device, b, t)] = prof
        return prof

    def all_anchors(self, threads: int | None = None) -> list[ModelProfile]:
        """The profiles measured (or priced) with ``threads`` (None: the cluster's), device
        type by device type: what a plan keeps."""
        t = self._threads(threads)
        return [p for key in sorted(self.anchors) if key[1] == t for p in self.anchors[key]]
