"""Every runtime knob, declared once: what a worker trains, and how ``planner run`` launches.

``python -m runtime`` (a worker) and ``planner run`` build their options from
these fields (:mod:`planner.plan.fields`) and parse into the same dataclasses;
``planner run`` hands a worker its options back as a command line
(:func:`planner.plan.fields.to_argv`), so nothing is listed twice. Validation
errors name the field and its flag.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from planner.plan.fields import add_options, option, option_error

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "LEARNING_RATES",
    "LOCAL_TIMEOUT_S",
    "NONFINITE_ACTIONS",
    "SPLIT_METHODS",
    "LaunchOptions",
    "RunOptions",
    "add_run_options",
]

DEFAULT_TIMEOUT_S = 300.0
"""How long a collective may wait on a peer before every rank gives up (seconds).

A rank that raises leaves its peers blocked in their next collective; this
bound is how long they wait before they fail too (reliability item 18).
``python -m runtime`` uses it (multi-node jobs start slowly).
"""

LOCAL_TIMEOUT_S = 120.0
"""``planner run``'s collective timeout (seconds): on one machine a peer that
has not answered in two minutes is gone."""

LEARNING_RATES = {"adam": 1e-3, "adamw": 1e-3, "sgd": 1e-2}
"""The optimizers a worker builds (sgd: with momentum 0.9), and their default rates."""

NONFINITE_ACTIONS = ("stop", "skip")
"""What a step with a NaN or infinite loss or gradient does (``runtime.gradients``)."""

SPLIT_METHODS = ("auto", "pipeline", "fx")
"""``auto``: ``pipeline`` first, ``fx`` when it fails; the others force one path."""


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """What a worker trains, with what, and what it saves and measures."""

    model_file: str = option(
        help="a model.py defining build_model() and sample_batch(n)", positional=True
    )
    plan: str = option(help="the plan file (`planner plan ... --out`)")
    steps: int = option(
        10,
        help="train until this many optimizer steps are done, counted from the start "
        "(a resumed run continues to it)",
    )
    checkpoint_dir: str | None = option(None, help="save to and resume from this folder")
    checkpoint_every: int = option(
        0, help="save every K steps (0: only at the end); needs --checkpoint-dir"
    )
    reshard: bool = option(
        False, help="resume from a checkpoint of another layout of the same model (by name)"
    )
    trace: str | None = option(None, help="write the measured Chrome/Perfetto trace here")
    memory: bool = option(
        True,
        help="time the steps only: no peak memory (on the CPU the peak is measured over the "
        "2 steps after warm-up, tracking every tensor, which slows them; they are not timed)",
        flag="--no-memory",
    )
    pin_cores: bool = option(
        True,
        help="leave the CPU workers to the OS scheduler (by default each keeps to cores of "
        "its own when the machine has enough: [Note: a core of its own] in runtime/launch.py)",
        flag="--no-pin-cores",
    )
    measurements: str | None = option(
        None,
        help="write every rank's timed actions and peak memory here (JSON), for "
        "`planner calibrate`",
        metavar="FILE",
    )
    optimizer: str | None = option(
        None,
        help="the optimizer (none: the plan's; sgd means SGD with momentum 0.9)",
        choices=sorted(LEARNING_RATES),
    )
    lr: float | None = option(None, help="the learning rate (none: 1e-3 for adam/adamw, 1e-2 sgd)")
    seed: int = option(0, help="model initialization and data seed")
    timeout: float | None = option(
        None,
        help="seconds a collective waits for a peer before failing (none: "
        f"{DEFAULT_TIMEOUT_S:.0f} for python -m runtime, {LOCAL_TIMEOUT_S:.0f} for planner run)",
    )
    split: str = option("auto", help="how to split the model into stages", choices=SPLIT_METHODS)
    warmup_steps: int = option(1, help="steps left out of the measured figures")
    step_log: str | None = option(
        None,
        help="every rank appends one JSON line per step to DIR/rank{R}.jsonl: step, loss, "
        "step seconds, resident set size (bytes)",
        metavar="DIR",
    )
    init_from: str | None = option(
        None,
        help="build only this rank's stage and fill it by name from PATH: a safetensors file "
        "(`planner init-weights`, or a pretrained model.safetensors) or a DCP checkpoint "
        "folder; without it every rank builds the whole model",
        metavar="PATH",
    )
    clip_grad_norm: float | None = option(
        None,
        help="clip the global gradient norm (every stage and replica, each tensor once) to "
        "this, as one process's clip_grad_norm_ would (none: no clipping)",
    )
    on_nonfinite: str = option(
        "stop",
        help="a step whose loss or gradients are NaN or infinite: stop (no update, no "
        "checkpoint, exit 1) or skip its update and go on",
        choices=NONFINITE_ACTIONS,
    )
    allow_device_mismatch: bool = option(
        False,
        help="run a plan made for GPUs on a machine without one (refused otherwise: its "
        "predicted times and memory are for other hardware)",
    )

    def __post_init__(self) -> None:
        for name in ("steps", "checkpoint_every", "warmup_steps"):
            if getattr(self, name) < 0:
                raise option_error(RunOptions, name, f"must be ≥ 0, got {getattr(self, name)}")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise option_error(
                RunOptions, "checkpoint_every", "needs --checkpoint-dir (where to save)"
            )
        if self.timeout is not None and not self.timeout > 0:
            raise option_error(RunOptions, "timeout", f"must be > 0 seconds, got {self.timeout}")
        if self.optimizer is not None and self.optimizer not in LEARNING_RATES:
            raise option_error(
                RunOptions,
                "optimizer",
                f"is {self.optimizer!r}; choose one of {', '.join(LEARNING_RATES)}",
            )
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise option_error(
                RunOptions, "clip_grad_norm", f"must be > 0, got {self.clip_grad_norm}"
            )
        if self.on_nonfinite not in NONFINITE_ACTIONS:
            raise option_error(
                RunOptions,
                "on_nonfinite",
                f"is {self.on_nonfinite!r}; choose one of {', '.join(NONFINITE_ACTIONS)}",
            )
        if self.init_from is not None and not os.path.exists(self.init_from):
            raise option_error(
                RunOptions,
                "init_from",
                f"is {self.init_from!r}, which does not exist; write it with `planner "
                "init-weights MODEL --out FILE`",
            )
        if self.split not in SPLIT_METHODS:
            raise option_error(
                RunOptions, "split", f"is {self.split!r}; choose one of {', '.join(SPLIT_METHODS)}"
            )


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """How ``planner run`` starts the workers on this machine."""

    max_restarts: int = option(
        0,
        help="restart all workers this many times after a failure (torchrun's option); "
        "with --checkpoint-dir they resume from the last complete checkpoint",
    )
    master_addr: str = option(
        "127.0.0.1", help="rendezvous address, also the workers' own (127.0.0.1: loopback)"
    )
    master_port: int = option(0, help="rendezvous port (0: a free one)")

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise option_error(
                LaunchOptions, "max_restarts", f"must be ≥ 0, got {self.max_restarts}"
            )


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The worker's options (``python -m runtime``); ``planner run`` adds its launch ones."""
    add_options(parser, RunOptions)
