"""Timed rounds: every block alone, the loss, and the whole unsplit model, interleaved.

Rounds interleave the blocks, the loss and the whole model so that all of them
see the same machine load; ``warmup`` rounds first, then at least ``repeats``
timed ones ([Note: adaptive repeats], [Note: quiet rounds]); the median of the
kept rounds is each figure, less the timing harness's own cost ([Note: harness
overhead]). The whole-model figure checks that splitting did not distort the
cost. The blocks run as generated code, as the runtime's stages do ([Note: the
stages run generated code] in ``runtime.split.pipeline``): no interpreter is
priced.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch import nn

from planner.capture.trace import Captured
from planner.options import ProfileOptions
from planner.plan.progress import Progress
from planner.profile.rounds import QUIET_SHARE, Measured, RoundTimes, kept_rounds, summarise
from planner.profile.runner import BlockRunner, loss_inputs

__all__ = [
    "MAX_MEASURE_S",
    "MAX_REPEATS",
    "MIN_MEASURE_S",
    "PROBE_LOOPS",
    "QUIET_SHARE",
    "SLOW_SPELL",
    "Measured",
    "Progress",
    "RoundLoad",
    "measure_blocks",
]


MIN_MEASURE_S = 1.0
"""Timed rounds continue until they add up to this many seconds (see adaptive repeats)."""
MAX_REPEATS = 50
"""...or until this many timed rounds."""
MAX_MEASURE_S = 15.0
"""On a busy machine, rounds go on for at most this long waiting for quiet ones."""
SLOW_SPELL = 1.4
"""A timed round is in a slow spell when the slower of its probes (1-element adds, before
and after it) took this many times the machine's time per op ([Note: a slow spell in the
rounds])."""
PROBE_LOOPS = 100
"""1-element adds per run of a probe (three runs, the fastest kept: about 0.4 ms)."""


def measure_blocks(
    model: nn.Module,
    cap: Captured,
    runners: list[BlockRunner],
    targets: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    options: ProfileOptions,
    progress: Progress | None,
) -> Measured:
    """Time every block, the loss and the whole model in interleaved rounds.

    [Note: adaptive repeats] A short model is timed for more rounds: at least
    ``repeats``, and more until the timed rounds add up to MIN_MEASURE_S (at most
    MAX_REPEATS), so a millisecond-scale model is not at the mercy of one hiccup.
    [Note: quiet rounds] On a shared machine another process's burst slows some
    rounds (and a multi-threaded round far more: its threads wait on each other).
    Each round's load is read from /proc/stat; rounds continue (up to
    MAX_MEASURE_S) until ``repeats`` were quiet, and only quiet rounds count, or,
    failing that, the least loaded half.

    [Note: a slow spell in the rounds] The shared host also has spells, seconds
    long, in which everything runs up to twice as slow and /proc/stat shows no other
    work ([Note: a transient slow spell] in ``planner.devices.cpu_speed``): a profile
    of MobileNetV3 at micro-batch 4 timed in one (calibration benchmark,
    2026-12-08) read 11.9 / 26.2 ms for its blocks' forward / backward against 7.7 /
    14.2 in the runs before, and a calibration fitted on it halved every other
    layout's compute (−42 and −47 %). So on the local CPU each timed round starts
    and ends with a probe (1-element adds, the fastest of three runs of
    ``PROBE_LOOPS``), and a round whose slower probe took ``SLOW_SPELL`` times the
    machine's time per op (the least of the planner's measured figure and every
    probe of this profile) counts as loaded: the rounds go on for quiet ones as they
    do on a busy machine.
    """
    rounds = _Rounds(model, cap, runners, targets, loss_fn, progress)
    load = RoundLoad(probe=_probe(model))
    # The progress total is fixed up front: the most rounds the loop below may run. It
    # usually stops earlier (enough quiet rounds), and the phase then ends at once.
    most = options.warmup + max(MAX_REPEATS, options.repeats)
    started: float | None = None
    r = 0
    while True:
        keep = r >= options.warmup
        if keep and started is None:
            started = time.perf_counter()
            load.start()
        kept = r - options.warmup
        if kept >= options.repeats and started is not None:
            spent = time.perf_counter() - started
            enough = spent >= MIN_MEASURE_S and load.quiet() >= options.repeats
            if enough or kept >= max(MAX_REPEATS, options.repeats) or spent >= MAX_MEASURE_S:
                break
        if keep:
            load.round_started()
        rounds.run(r, most, keep)
        if keep:
            load.round_done()
        r += 1
    use = load.selection()
    if progress is not None:
        total = most * (len(runners) + 1)
        progress(rounds.phase, total, total, f"{r} rounds, {len(use)} kept")
    return summarise(rounds.times, load.effective(), _harness_overhead())


class _Rounds:
    """One round at a time: every block, then the whole model and the loss; the times kept."""

    def __init__(
        self,
        model: nn.Module,
        cap: Captured,
        runners: list[BlockRunner],
        targets: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        progress: Progress | None,
    ) -> None:
        self.model, self.cap, self.runners = model, cap, runners
        self.targets, self.loss_fn, self.progress = targets, loss_fn, progress
        n = len(runners)
        self.times = RoundTimes.empty(n)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.whole_grads: list[torch.Tensor] | None = None
        self.phase = f"timing {n} blocks"

    def run(self, r: int, most: int, keep: bool) -> None:
        """Round ``r`` (of at most ``most``); the progress counts blocks run."""
        n = len(self.runners)
        for k, runner in enumerate(self.runners):
            t0 = time.perf_counter()
            outs = runner.forward()
            t1 = time.perf_counter()
            runner.backward(outs)
            t2 = time.perf_counter()
            del outs
            if keep:
                self.times.fwd[k].append((t1 - t0) * 1e3)
                self.times.bwd[k].append((t2 - t1) * 1e3)
            self._tick(r * (n + 1) + k + 1, most * (n + 1), r)
        self._whole(keep)
        self._tick((r + 1) * (n + 1), most * (n + 1), r)

    def _tick(self, done: int, total: int, r: int) -> None:
        # One short of the total at most: measure_blocks ends the phase when it stops.
        if self.progress is not None:
            self.progress(self.phase, min(done, total - 1), total, f"round {r + 1}")

    def _whole(self, keep: bool) -> None:
        """The whole captured graph, unsplit, and the loss on its output.

        The graph the blocks were cut from, not the eager model: the check is
        of splitting alone (on the zoo's transformers the exported graph runs
        3-11 % slower than their eager code; a one-stage plan runs the latter).
        """
        t0 = time.perf_counter()
        out = self.cap.gm(*self.cap.sample_args, **self.cap.sample_kwargs)
        t1 = time.perf_counter()
        flat_out = [
            o
            for o in torch.utils._pytree.tree_leaves(out)
            if isinstance(o, torch.Tensor) and o.requires_grad
        ]
        if self.whole_grads is None:
            gen = torch.Generator().manual_seed(0)
            self.whole_grads = [
                torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in flat_out
            ]
        if flat_out:
            torch.autograd.grad(flat_out, self.params, self.whole_grads, allow_unused=True)
        t2 = time.perf_counter()
        if keep:
            self.times.whole_f.append((t1 - t0) * 1e3)
            self.times.whole_b.append((t2 - t1) * 1e3)
        if self.loss_fn is not None:
            lf, lb = _time_loss(out, self.targets, self.loss_fn)
            if keep:
                self.times.loss_f.append(lf)
                self.times.loss_b.append(lb)


def _busy_s() -> float | None:
    """CPU seconds the whole machine has spent busy since boot (Linux), else None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class RoundLoad:
    """Other processes' share of the cores per timed round ([Note: quiet rounds]).

    /proc/stat counts in 10 ms ticks, so rounds are read in windows of at least
    ``window_s``; every round of a window gets the window's share.
    """

    def __init__(
        self, window_s: float = 0.2, probe: tuple[Callable[[], float], float] | None = None
    ) -> None:
        self.window_s = window_s
        self.shares: list[float] = []
        self.pending = 0
        self.cores = os.cpu_count() or 1
        # [Note: a slow spell in the rounds]: (seconds per op now, the machine's figure)
        self.probe = probe
        self.probes: list[float] = []  # per round: the slower of its probes before and after
        self.before = 0.0

    def start(self) -> None:
        self.t0, self.busy0, self.own0 = time.perf_counter(), _busy_s(), time.process_time()

    def round_started(self) -> None:
        self.before = self.probe[0]() if self.probe is not None else 0.0

    def round_done(self) -> None:
        if self.probe is not None:  # a spell may start or end within the round
            self.probes.append(max(self.before, self.probe[0]()))
        self.pending += 1
        if time.perf_counter() - self.t0 >= self.window_s:
            self._close_window()

    def _close_window(self) -> None:
        if not self.pending:
            return
        wall = time.perf_counter() - self.t0
        busy = _busy_s()
        share = 0.0
        if busy is not None and self.busy0 is not None and wall > 0:
            own = time.process_time() - self.own0
            share = max(0.0, busy - self.busy0 - own) / (wall * self.cores)
        self.shares += [share] * self.pending
        self.pending = 0
        self.start()

    def slow(self) -> list[bool]:
        """Per probed round, whether it was in a slow spell ([Note: a slow spell in the
        rounds])."""
        if self.probe is None or not self.probes:
            return [False] * len(self.shares)
        ref = min(self.probe[1], *self.probes)
        return [t > SLOW_SPELL * ref for t in self.probes]

    def effective(self) -> list[float]:
        """Per round of a closed window, its share, or 1 (all the cores) in a slow spell."""
        return [1.0 if s else x for x, s in zip(self.shares, self.slow(), strict=False)]

    def quiet(self) -> int:
        return sum(x < QUIET_SHARE for x in self.effective())

    def selection(self) -> list[int]:
        """Indices of the rounds to keep (every window closed first)."""
        self._close_window()
        return kept_rounds(self.effective())


def _probe(model: nn.Module) -> tuple[Callable[[], float], float] | None:
    """The local CPU's slow-spell probe and its reference time per op (the planner's
    measured figure at this thread count, when this process has it; else none but the
    probes' own least), or None for a model on another device."""
    param = next(model.parameters(), None)
    if param is not None and param.device.type != "cpu":
        return None
    from planner.devices import cpu_speed

    speed = cpu_speed.known(torch.get_num_threads())
    ref = speed.op_overhead_s if speed is not None else float("inf")
    return (lambda: cpu_speed.op_time_s(PROBE_LOOPS, 3)), ref


def _harness_overhead(rounds: int = 60) -> tuple[float, float]:
    """Forward and backward time (ms) of a block that does nothing, timed like a block.

    [Note: harness overhead] Timing a block alone costs a module call and an
    ``autograd.grad`` call that the whole model does not pay per block; left
    in, it inflates Σ blocks by ~0.03 ms per block here (≈ 4 % of the 9-block
    MLP example). It is measured with the same harness and subtracted.
    """
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output((graph.call_function(torch.ops.aten.mul.Tensor, (x, 1.0)),))
    module = torch.fx.GraphModule(nn.Module(), graph)
    inp = torch.zeros(1, requires_grad=True)
    grad = [torch.ones(1)]
    fwd, bwd = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = module(inp)
        t1 = time.perf_counter()
        torch.autograd.grad(list(out), [inp], grad)
        t2 = time.perf_counter()
        fwd.append((t1 - t0) * 1e3)
        bwd.append((t2 - t1) * 1e3)
    return statistics.median(fwd[10:]), statistics.median(bwd[10:])


def _time_loss(
    out: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor]
) -> tuple[float, float]:
    detached, leaves = loss_inputs(out)
    t0 = time.perf_counter()
    loss = loss_fn(detached, targets)
    t1 = time.perf_counter()
    if leaves and loss.requires_grad:
        torch.autograd.grad(loss, leaves, allow_unused=True)
    t2 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3
