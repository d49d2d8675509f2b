"""Plain-data records of a profiled model: what the planner knows about each block.

These records are the contract between the torch side (capture, blocks, profile)
and the pure side (cost, solve, search, plan). They hold numbers only, never
tensors, and round-trip through plain dicts so a plan file can carry the profile
it was solved on.

Units: times in milliseconds, sizes in bytes, FLOPs as counts. Every per-block
figure is for one micro-batch of ``ModelProfile.batch_size`` samples.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from planner.plan.codec import Record

__all__ = [
    "DTYPE_BYTES",
    "MIN_QUIET_ROUNDS",
    "BlockCost",
    "Calibration",
    "ModelProfile",
    "SplitCheck",
    "TiedSet",
]

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}
"""Bytes per element of the dtype names a profile uses (``ModelProfile.dtype``)."""

MIN_QUIET_ROUNDS = 3
"""Fewer quiet timed rounds than this (or than all rounds), and the profile's times are
medians of the least loaded half, and the split check is not judged."""


@dataclass(frozen=True, kw_only=True)
class BlockCost(Record):
    """The measured (or analytic) cost of one block.

    Attributes:
        index: position in the chain, 0 first.
        name: the block's split point: FQN of the module call it starts with
            ("" only for a first block that begins with root-level code).
        modules: FQNs of the module calls the block holds, in execution order.
        fwd_ms: forward time of one micro-batch.
        bwd_ms: backward time of one micro-batch (input and weight gradients).
        param_bytes: bytes of the parameters the block owns. A tied parameter is
            owned by the first block that uses it; later users see it in
            ``TiedSet``.
        param_tensors: bytes of each of those parameter tensors, largest first
            (what a ZeRO-1 replica's share is made of: [Note: ZeRO-1 shares]);
            empty in older profiles.
        buffer_bytes: bytes of buffers (e.g. BatchNorm statistics) the block owns.
        activation_bytes: bytes saved for backward (autograd's saved tensors,
            parameters excluded) during one micro-batch's forward.
        output_bytes: bytes of the tensors the block produces that later blocks
            or the model's output read.
        boundary_bytes: bytes of every tensor live across this block's split
            point (skip connections and model inputs included): what a stage
            starting here receives per micro-batch. 0 for block 0.
        crossing: those tensors as traced ("name: dtype[shape]", at the
            micro-batch size of the capture); empty in older profiles.
        boundary_copy_bytes: the part of ``boundary_bytes`` in strided (not
            contiguous) tensors: the sending stage copies them dense first, and
            the receiving one their gradients (0 in older profiles).
        boundary_grad_bytes: the part of ``boundary_bytes`` in floating-point
            tensors, whose gradients come back (None in older profiles: all of it).
        fwd_flops: forward FLOPs (``torch.utils.flop_counter``'s count).
        bwd_flops: backward FLOPs.
        fwd_bytes_moved: bytes read and written by the forward's operators (the
            memory-traffic term of the analytic roofline).
    """

    index: int
    name: str
    modules: tuple[str, ...]
    fwd_ms: float
    bwd_ms: float
    param_bytes: int
    param_tensors: tuple[int, ...] = ()
    buffer_bytes: int = 0
    activation_bytes: int
    output_bytes: int
    boundary_bytes: int
    crossing: tuple[str, ...] = ()
    boundary_copy_bytes: int = 0
    boundary_grad_bytes: int | None = None
    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    fwd_bytes_moved: float = 0.0

    @property
    def step_ms(self) -> float:
        """Forward plus backward time of one micro-batch."""
        return self.fwd_ms + self.bwd_ms


@dataclass(frozen=True, kw_only=True)
class TiedSet(Record):
    """Parameters that are one tensor under several names (tied weights).

    Attributes:
        names: every FQN of the tensor, e.g. ("tok_emb.weight", "head.weight").
        blocks: indices of the blocks that use the tensor, ascending.
        nbytes: size of the tensor (one copy).
    """

    names: tuple[str, ...]
    blocks: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True, kw_only=True)
class SplitCheck(Record):
    """Σ blocks against the whole unsplit model, timed alike ([Note: the split check]).

    Attributes:
        blocks_ms: Σ over blocks of forward + backward as timed, plus the loss,
            in the least disturbed kept round.
        whole_ms: the whole model's forward + backward plus the same loss, in
            its least disturbed kept round.
        rounds: timed rounds run.
        kept: rounds kept (the quiet ones, else the least loaded half).
        quiet: rounds in which other processes kept under 10 % of the cores busy, and
            no slow spell of the machine's ([Note: a slow spell in the rounds]).
        load_share: median share of the cores other processes kept busy.
        charge_ms: what a block timed alone pays and a stage does not, taken off
            every block's forward + backward ([Note: split charge]); 0 when the
            blocks were not slower or the check was not judged.
    """

    blocks_ms: float
    whole_ms: float
    rounds: int
    kept: int
    quiet: int
    load_share: float = 0.0
    charge_ms: float = 0.0

    @property
    def judged(self) -> bool:
        """Enough rounds were quiet for the two totals to say what the work costs."""
        return self.quiet >= min(MIN_QUIET_ROUNDS, self.rounds)

    @property
    def error(self) -> float:
        """(Σ blocks − whole) / whole."""
        return (self.blocks_ms - self.whole_ms) / self.whole_ms if self.whole_ms else 0.0


@dataclass(frozen=True, kw_only=True)
class Calibration(Record):
    """Corrections to the cost model, fitted from a run of a plan (``planner calibrate``).

    A profile carrying one (``ModelProfile.calibration``) has its blocks' and
    loss's times already multiplied by ``fwd_scale`` and ``bwd_scale``
    (``planner.cost.calibration``); the other figures replace the cost model's
    defaults while it prices a layout. A figure the run could not determine is
    left at 1 (or None: the default) and not named in ``fitted``.

    Attributes:
        fwd_scale / bwd_scale: measured ÷ profiled compute of one forward /
            backward action (per device type: each profile has its own).
        action_overhead_ms: the fixed cost of one pipeline action (None: the
            backend's ``ACTION_OVERHEAD_MS``), fitted last, so that the
            simulated step of the run's placement is its measured step.
        corun_slowdown: local CPU pipeline stages computing at once run this
            much slower than alone; it prices layouts of one replica (None, and
            any layout with replicas: ``CPU_CORUN_SLOWDOWN``; [Note: whose co-run
            a calibration fits] in ``planner.cost.stage_time``).
        optimizer_scale / allreduce_scale: measured ÷ predicted optimizer step
            and DDP gradient all-reduce.
        p2p_extra_ms: what a transfer between stages took beyond its predicted
            time (a message's fixed cost: the handshake, waking the receiver),
            added to each one.
        fitted: the names of the fields the run determined.
        source: the run it was fitted on (layout, devices, steps counted).
        measured_step_ms: that run's median step.
        before_ms / after_ms: its placement's predicted step without and with
            this calibration.
    """

    fwd_scale: float = 1.0
    bwd_scale: float = 1.0
    action_overhead_ms: float | None = None
    corun_slowdown: float | None = None
    optimizer_scale: float = 1.0
    p2p_extra_ms: float = 0.0
    allreduce_scale: float = 1.0
    fitted: tuple[str, ...] = ()
    source: str = ""
    measured_step_ms: float = 0.0
    before_ms: float = 0.0
    after_ms: float = 0.0

    def check_figures(self, path: str = "calibration") -> None:
        """Every number is finite and ≥ 0 (see ``ModelProfile.check_figures``)."""
        _check_figures(self, path)


@dataclass(frozen=True, kw_only=True)
class ModelProfile(Record):
    """Every block's cost at one micro-batch size on one device.

    Attributes:
        fingerprint: the model's fingerprint (graph + parameter shapes).
        source: "measured" (timed here) or "analytic" (FLOPs and bytes against a
            catalogue device).
        device: catalogue key of the device the times are for ("cpu", "h100", ...).
        batch_size: samples per micro-batch the figures are for.
        dtype: the dtype activations and parameters were costed in.
        threads: torch intra-op threads while measuring (0 for analytic).
        capture: how the graph was captured ("export" or "symbolic_trace").
        blocks: the chain, in execution order.
        tied: tied-parameter sets.
        input_bytes: bytes of one micro-batch of model inputs.
        target_bytes: bytes of one micro-batch of the loss's targets (0 in profiles
            made before it was recorded).
        loss_fwd_ms / loss_bwd_ms: the loss function's cost on the last stage.
        whole_fwd_ms / whole_bwd_ms: a measured forward and backward of the whole
            captured graph, unsplit (None for analytic profiles): the check that
            splitting did not distort the cost.
        split_check: the same check taken round by round (None for analytic
            profiles and older ones).
        repeats: timed repeats per figure (median taken).
        calibration: the corrections applied to these figures (None: as profiled).
    """

    fingerprint: str
    source: str
    device: str
    batch_size: int
    dtype: str
    threads: int
    capture: str
    blocks: tuple[BlockCost, ...]
    tied: tuple[TiedSet, ...] = ()
    input_bytes: int = 0
    target_bytes: int = 0
    loss_fwd_ms: float = 0.0
    loss_bwd_ms: float = 0.0
    whole_fwd_ms: float | None = None
    whole_bwd_ms: float | None = None
    split_check: SplitCheck | None = None
    repeats: int = 0
    notes: tuple[str, ...] = field(default=())
    calibration: Calibration | None = None

    @property
    def blocks_step_ms(self) -> float:
        """Σ over blocks of forward + backward, plus the loss."""
        return sum(b.step_ms for b in self.blocks) + self.loss_fwd_ms + self.loss_bwd_ms

    @property
    def whole_step_ms(self) -> float | None:
        if self.whole_fwd_ms is None or self.whole_bwd_ms is None:
            return None
        return self.whole_fwd_ms + self.whole_bwd_ms

    @property
    def split_distortion(self) -> float | None:
        """(Σ blocks − whole) / whole; None when no whole-model measurement exists."""
        whole = self.whole_step_ms
        if not whole:
            return None
        return (self.blocks_step_ms - whole) / whole

    @property
    def param_bytes(self) -> int:
        return sum(b.param_bytes for b in self.blocks)

    def check_figures(self, path: str = "profile") -> None:
        """Every number in the profile is finite and ≥ 0 (times, sizes, counts, indices).

        The codec checks types only; a NaN or negative time (a cache entry edited by
        hand, or damaged) would price every stage wrongly without a word.

        Example::

            prof.check_figures("profile-0abc.json")
            # ValueError: profile-0abc.json.blocks[3].fwd_ms is nan, not a finite number ≥ 0

        Raises:
            ValueError: the first number that is not, with its key path.
        """
        _check_figures(self, path)


def _check_figures(value: Any, path: str) -> None:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            _check_figures(getattr(value, f.name), f"{path}.{f.name}")
    elif isinstance(value, (tuple, list)):
        for k, item in enumerate(value):
            _check_figures(item, f"{path}[{k}]")
    elif _number(value) and not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{path} is {value!r}, not a finite number ≥ 0")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
