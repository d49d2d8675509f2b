"""Every planning knob, declared once: what a step trains, what to search, how to profile.

``planner plan`` and ``planner profile`` build their flags from these fields
(:mod:`planner.plan.fields`) and parse into the same dataclasses that
``plan_model`` and ``auto_parallel`` take, so each default and each help text
is written here only. Validation errors name the field and its flag.

Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.plan.fields import option, option_error
from planner.plan.schedule import MULTI_STAGE, SCHEDULES
from planner.plan.sections import DP_MODES
from planner.solve.problem import SOLVERS

__all__ = [
    "DP_MODES",
    "OPTIMIZERS",
    "PRECISIONS",
    "PROFILE_DTYPES",
    "PlanOptions",
    "ProfileOptions",
    "SearchOptions",
    "Training",
]

OPTIMIZERS = ("adam", "adamw", "sgd")
"""Optimizers the planner budgets memory for (SGD: with momentum)."""
PRECISIONS = ("fp32", "bf16-mixed")
"""Training precisions the planner prices."""
PROFILE_DTYPES = ("fp32", "bf16", "fp16")
"""Dtypes an analytic profile can cost a model in."""


@dataclass(frozen=True, kw_only=True)
class Training:
    """What one step trains on, and with what."""

    global_batch: int = option(
        help="global batch: samples per optimizer step, over all replicas",
        flag="--batch-size",
        unset="the model file's BATCH_SIZE",
    )
    optimizer: str = option(
        "adam",
        help="the optimizer, which sets the state kept per parameter: Adam and AdamW two "
        "moments, SGD one momentum",
        choices=OPTIMIZERS,
    )
    precision: str = option(
        "fp32",
        help="fp32, or bf16-mixed (autocast to bf16: fp32 weights, gradients and optimizer "
        "state; bf16 activations, a bf16 copy of the weights per step, bf16 gradient "
        "all-reduce)",
        choices=PRECISIONS,
    )
    memory_headroom: float = option(
        0.1,
        help="share of each device's memory kept free for the allocator's fragmentation, "
        "workspaces and the runtime",
    )

    def __post_init__(self) -> None:
        if isinstance(self.global_batch, bool) or self.global_batch < 1:
            raise option_error(Training, "global_batch", f"must be ≥ 1, got {self.global_batch}")
        for name, allowed in (("optimizer", OPTIMIZERS), ("precision", PRECISIONS)):
            value = getattr(self, name)
            if value not in allowed:
                raise option_error(
                    Training, name, f"is {value!r}; choose one of {', '.join(allowed)}"
                )
        if not 0 <= self.memory_headroom < 1:
            raise option_error(
                Training, "memory_headroom", f"must be in [0, 1), got {self.memory_headroom}"
            )


@dataclass(frozen=True, kw_only=True)
class SearchOptions:
    """What to search, and what is pinned (None: search it)."""

    pp: int | None = option(None, help="pin the pipeline depth")
    dp: int | None = option(None, help="pin the data-parallel width")
    micro_batches: int | None = option(None, help="pin the micro-batch count")
    schedule: str | None = option(None, help="pin the schedule", choices=(*SCHEDULES, *MULTI_STAGE))
    virtual: int | None = option(
        None,
        help="pin the stages per pipeline rank (v; 1 for gpipe and 1f1b, 2 or more for "
        "interleaved-1f1b and looped-bfs, 1 or more for interleaved-zb (1: ZB-1p), 2 for zbv "
        "and dualpipev)",
        flag="--virtual-stages",
    )
    dp_mode: str = option(
        "ddp",
        help="how replicas hold the optimizer state: ddp, each all of it; zero1, each a share "
        "(ZeRO-1: less memory, the weights sent after each step); fsdp, each a shard of the "
        "weights, gradients and state (FSDP: the weights gathered for each step's forwards and "
        "backwards, the gradients reduce-scattered after them); auto searches all three",
        choices=(*DP_MODES, "auto"),
    )
    solver: str = option(
        "highs", help="the ILP solver (auto: HiGHS when installed, else CBC)", choices=SOLVERS
    )
    time_limit_s: float | None = option(
        60.0,
        help="seconds per ILP solve; the best placement found by then is kept and marked "
        "not proven optimal, with its gap",
        flag="--time-limit",
    )
    # [Note: robust band] in planner.search.robust. No percent sign in the help: argparse
    # formats help text with %.
    robust_band_pct: float = option(
        8.0,
        help="the cost model's error band, in percent of the fastest predicted step: among "
        "the configurations predicted within it, the sturdiest is chosen (fewer stages, then "
        "less bubble and communication, then more free memory, then faster), not the "
        "fastest; 8: the accuracy benchmark's median |step error| of 8.0 percent (README, "
        "cost-model accuracy); 0: always the fastest",
        flag="--robust-band",
        metavar="PCT",
    )
    max_micro_batches: int = option(64, help="the largest micro-batch count considered", cli=False)
    max_virtual: int = option(
        1,
        help="the most stages per pipeline rank the search considers (interleaved-1f1b, "
        "looped-bfs and interleaved-zb at v = 2 up to it; with them interleaved-zb at v = 1, "
        "ZB-1p, and zbv and dualpipev at v = 2); 1, the default: gpipe and 1f1b only, unless "
        "--schedule or --virtual-stages asks for more (their step solves are still slow: "
        "README, schedules)",
        flag="--max-virtual-stages",
    )
    keep: int = option(12, help="how many candidates the plan records", cli=False)
    every_device: bool = option(
        False,
        help="pp × dp = every device, also on a local CPU cluster (a job whose process "
        "count is fixed: auto_parallel under torchrun)",
        cli=False,
    )

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "micro_batches", "max_micro_batches", "keep", "virtual",
                     "max_virtual"):  # fmt: skip
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or v < 1):
                raise option_error(SearchOptions, name, f"must be ≥ 1, got {v}")
        if self.schedule is not None and self.schedule not in (*SCHEDULES, *MULTI_STAGE):
            raise option_error(
                SearchOptions,
                "schedule",
                f"is {self.schedule!r}; choose one of {', '.join((*SCHEDULES, *MULTI_STAGE))}",
            )
        if self.dp_mode not in (*DP_MODES, "auto"):
            raise option_error(
                SearchOptions,
                "dp_mode",
                f"is {self.dp_mode!r}; choose one of {', '.join((*DP_MODES, 'auto'))}",
            )
        if self.solver not in SOLVERS:
            raise option_error(
                SearchOptions, "solver", f"is {self.solver!r}; choose one of {', '.join(SOLVERS)}"
            )
        if not 0 <= self.robust_band_pct < 100:
            raise option_error(
                SearchOptions,
                "robust_band_pct",
                f"must be a percentage in [0, 100), got {self.robust_band_pct} (8: the cost "
                "model's measured median error; 0: always the fastest)",
            )
        if self.time_limit_s is not None and not self.time_limit_s > 0:
            raise option_error(
                SearchOptions, "time_limit_s", f"must be > 0 seconds, got {self.time_limit_s}"
            )

    @property
    def dp_modes(self) -> tuple[str, ...]:
        """The dp modes searched: the pinned one, or every one ("auto": ddp, zero1, fsdp)."""
        return DP_MODES if self.dp_mode == "auto" else (self.dp_mode,)


@dataclass(frozen=True, kw_only=True)
class ProfileOptions:
    """How to profile."""

    device: str = option(
        "local",
        help="'local' to measure on this machine, or a catalogue device for analytic costs "
        "of a device not here (h100, h200, a100-80gb, a100-40gb, v100-32gb, v100-16gb, l4)",
        flag="--device-type",
    )
    dtype: str | None = option(
        None,
        help="analytic only: cost activations and FLOPs as this dtype (none: the model's own)",
        choices=PROFILE_DTYPES,
    )
    repeats: int = option(
        5, help="timed rounds per figure, the median kept (raise it on a noisy machine)"
    )
    warmup: int = option(2, help="untimed rounds first (allocator and caches warm up)")
    threads: int | None = option(
        None,
        help="torch threads while measuring (none: the current setting); profile with the "
        "thread count each training process will have",
    )
    target_blocks: int = option(
        64,
        help="granularity: blocks fine enough to balance this many stages (descend into any "
        "module call holding more than 1/N of the work)",
        flag="--max-stages",
    )
    cache: bool = option(True, help="ignore and do not write the profile cache", flag="--no-cache")
    calibration: bool = option(
        True,
        help="ignore the calibration `planner calibrate` stored for this model, device and "
        "precision (by default it corrects the cost model, and the report says so)",
        flag="--no-calibration",
    )
    split_points: tuple[str, ...] | None = option(
        None,
        help="use exactly these split points instead of the granularity rule (the same "
        "chain at another batch size or on another device)",
        cli=False,
    )

    def __post_init__(self) -> None:
        for name, least in (("repeats", 1), ("warmup", 0), ("threads", 1), ("target_blocks", 1)):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or v < least):
                raise option_error(ProfileOptions, name, f"must be ≥ {least}, got {v}")
        if self.dtype is not None and self.device == "local":
            raise option_error(
                ProfileOptions,
                "dtype",
                "applies to analytic profiles only: pass a catalogue device (e.g. "
                f"device='h100', --device-type h100) with dtype={self.dtype!r}, or leave it unset",
            )

    @property
    def analytic(self) -> bool:
        return self.device != "local"


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """Everything ``planner plan`` takes besides the model and the cluster."""

    training: Training
    search: SearchOptions = field(default_factory=SearchOptions)
    profile: ProfileOptions = field(default_factory=ProfileOptions)
