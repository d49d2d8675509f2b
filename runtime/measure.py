"""What a running plan actually does: per-stage forward/backward time, step time, peak memory.

Example::

    with Recorder(pmodel) as rec:
        for step in range(steps):
            pmodel.step(x, y)
        result = rec.gather()                 # a collective; rank 0 gets the figures
    if result is not None:
        print(comparison_table(pmodel.plan, result))
        write_trace(result, "measured.trace.json")

How the times are taken. ``torch.distributed.pipelining`` has no public
per-action timing hook, so the :class:`Recorder` wraps, on this rank's objects
only (instance attributes, restored by :meth:`Recorder.close`):

* ``PipelineStage.forward_one_chunk`` / ``backward_one_chunk``: one call is
  one action of the schedule, ``F k`` / ``B k`` for micro-batch k, its own
  compute only (the schedule waits for received activations or gradients
  *outside* these calls, so waiting is not counted as work). On the last
  stage the loss (the schedule's ``_loss_fn``, when present) is timed too and
  counted in the forward, as the planner's prediction counts it;
* ``ParallelModel.step``: the step's wall time; the optimizer's step through
  its public pre/post hooks; the tied-weight gradient sum.

On CUDA each timed interval is bracketed by ``torch.cuda.synchronize`` (the
kernels are asynchronous), which costs some overlap: measure, then train
without the recorder. Peak memory: ``torch.cuda.max_memory_allocated`` on
CUDA; on the CPU (no allocator statistics) the bytes of the stage's
tensors that outlive a step (parameters, buffers, gradients, optimizer state;
counted after the warm-up) plus the growth of the process's peak resident
set (``ru_maxrss``, its peak reset through ``/proc/self/clear_refs`` where
Linux allows) over the counted steps: activations, temporaries, allocator
slack. An approximation, to compare with the plan's prediction.

The first ``warmup_steps`` recorded steps (allocations, first-call costs) are
left out of the figures. Ranks' clocks are aligned by a barrier when the
recorder starts (good to about a millisecond on one machine).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from planner.plan import Plan
    from runtime.engine import ParallelModel

__all__ = ["Interval", "Measurement", "RankRecord", "Recorder", "comparison_table", "write_trace"]

log = logging.getLogger(__name__)

_MIB = 2**20


@dataclass(frozen=True)
class Interval:
    """One timed action: ``kind`` "F", "B", "loss", "tied", "optimizer" or "step".

    ``start`` and ``end`` are seconds since the recorder started (aligned
    across ranks); ``micro_batch`` is -1 for whole-step actions.
    """

    kind: str
    step: int
    micro_batch: int
    start: float
    end: float

    @property
    def ms(self) -> float:
        return (self.end - self.start) * 1e3


@dataclass
class RankRecord:
    """One rank's record, as gathered to rank 0."""

    rank: int
    replica: int
    stage: int
    device: str
    intervals: list[Interval] = field(default_factory=list)
    peak_bytes: float = 0.0
    memory_method: str = ""

    def durations(self, kind: str, steps: set[int], skip_mb: int | None = None) -> list[float]:
        """Milliseconds of every ``kind`` action in ``steps``; a forward includes its loss.

        ``skip_mb``: leave out this micro-batch's actions (see ``stage_figures``).
        """
        out: dict[tuple[int, int], float] = {}
        for iv in self.intervals:
            if iv.step not in steps or (skip_mb is not None and iv.micro_batch == skip_mb):
                continue
            if iv.kind == kind or (kind == "F" and iv.kind == "loss"):
                key = (iv.step, iv.micro_batch)
                out[key] = out.get(key, 0.0) + iv.ms
        return list(out.values())


@dataclass
class Measurement:
    """Every rank's record (rank 0, after :meth:`Recorder.gather`) and which steps count."""

    records: list[RankRecord]
    steps: list[int]  # recorded steps, in order
    counted: list[int]  # the ones after warm-up (the figures' source)
    global_batch: int

    def stage_figures(
        self, stage: int, *, skip_last_backward: int | None = None
    ) -> dict[str, float]:
        """Medians over the counted steps (and over replicas) for one stage.

        ``skip_last_backward=m``: leave micro-batch m − 1's backward out (with
        dp > 1 it holds DDP's gradient all-reduce; see ``comparison_table``).
        """
        counted = set(self.counted)
        recs = [r for r in self.records if r.stage == stage]
        skip = None if skip_last_backward is None else skip_last_backward - 1
        fwd = [d for r in recs for d in r.durations("F", counted)]
        bwd = [d for r in recs for d in r.durations("B", counted, skip)]
        step = [d for r in recs for d in r.durations("step", counted)]
        return {
            "fwd_ms": _median(fwd),
            "bwd_ms": _median(bwd),
            "step_ms": _median(step),
            "peak_bytes": max((r.peak_bytes for r in recs), default=float("nan")),
        }

    @property
    def step_ms(self) -> float:
        """Median over counted steps of the slowest rank's step time."""
        counted = set(self.counted)
        per_step: dict[int, float] = {}
        for r in self.records:
            for iv in r.intervals:
                if iv.kind == "step" and iv.step in counted:
                    per_step[iv.step] = max(per_step.get(iv.step, 0.0), iv.ms)
        return _median(list(per_step.values()))

    @property
    def samples_per_s(self) -> float:
        ms = self.step_ms
        return self.global_batch / (ms / 1e3) if ms > 0 else float("nan")


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# --------------------------------------------------------------------------- recording


class Recorder:
    """Times this rank's pipeline actions and steps; see the module docstring.

    Args:
        pmodel: the running model; every rank creates its recorder at the same
            point (the constructor is a collective: a barrier aligns the clocks).
        warmup_steps: recorded steps left out of the figures (not of the trace).
        keep_steps: intervals are kept for the last this-many steps only (the
            figures and the trace come from them); older ones are dropped.
        first_step: the training step (0-based) the first recorded step is,
            e.g. the step a run resumed at; steps are reported 1-based.
    """

    def __init__(
        self,
        pmodel: ParallelModel,
        *,
        warmup_steps: int = 1,
        keep_steps: int = 50,
        first_step: int = 0,
    ):
        if warmup_steps < 0 or keep_steps < 1:
            raise ValueError(
                f"warmup_steps must be ≥ 0 and keep_steps ≥ 1, got {warmup_steps}, {keep_steps}"
            )
        self.pmodel = pmodel
        self.warmup_steps = warmup_steps
        self.keep_steps = keep_steps
        self.device = pmodel.mesh.device
        self._sync = self.device.type == "cuda"
        self._intervals: list[Interval] = []
        self._steps: list[int] = []
        self._first = first_step
        self._step = first_step - 1
        self._losses = 0
        self._undo: list[Callable[[], None]] = []
        self._mem = _MemoryProbe(self.device)
        self._wrap()
        if dist.is_initialized() and self._sync:
            dist.barrier(device_ids=[self.device.index])
        elif dist.is_initialized():
            dist.barrier()
        self._t0 = time.perf_counter()
        self._mem.start(_state_bytes(pmodel))

    # -------------------------------------------------------------- wrapping

    def _clock(self) -> float:
        if self._sync:
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self._t0

    def _timed(self, kind: str, fn: Callable[..., Any], mb_of: Callable[..., int]) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = self._clock()
            try:
                return fn(*args, **kwargs)
            finally:
                mb = mb_of(*args, **kwargs)
                self._intervals.append(Interval(kind, self._step, mb, start, self._clock()))

        return run

    def _patch(self, obj: Any, name: str, wrapper: Any) -> None:
        had = name in vars(obj)
        old = vars(obj).get(name)
        setattr(obj, name, wrapper)

        def undo() -> None:
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)

        self._undo.append(undo)

    def _wrap(self) -> None:
        pm = self.pmodel
        stage = pm.stage.pipeline_stage

        def chunk(*args: Any, **kwargs: Any) -> int:
            for key in ("fwd_chunk_id", "bwd_chunk_id"):
                if key in kwargs:
                    return int(kwargs[key])
            return int(args[0]) if args else -1

        self._patch(stage, "forward_one_chunk", self._timed("F", stage.forward_one_chunk, chunk))
        self._patch(stage, "backward_one_chunk", self._timed("B", stage.backward_one_chunk, chunk))
        loss_fn = getattr(pm.schedule, "_loss_fn", None)  # private: timed when present
        if callable(loss_fn):

            def loss_mb(*args: Any, **kwargs: Any) -> int:
                self._losses += 1  # the schedule computes the losses in micro-batch order
                return self._losses - 1

            self._patch(pm.schedule, "_loss_fn", self._timed("loss", loss_fn, loss_mb))
        if pm.tied.mine:
            self._patch(pm.tied, "sync_grads", self._timed("tied", pm.tied.sync_grads, _whole))
        if pm.optimizer is not None:
            began: dict[str, float] = {}

            def pre(*_: Any) -> None:
                began["t"] = self._clock()

            def post(*_: Any) -> None:
                t = began.pop("t", None)
                if t is not None:
                    self._intervals.append(Interval("optimizer", self._step, -1, t, self._clock()))

            handles = [
                pm.optimizer.register_step_pre_hook(pre),
                pm.optimizer.register_step_post_hook(post),
            ]
            self._undo.extend(h.remove for h in handles)
        step = pm.step

        def timed_step(*args: Any, **kwargs: Any) -> Any:
            self._step += 1
            self._steps.append(self._step)
            if self.warmup_steps and self._step == self._first + self.warmup_steps:
                self._mem.start(_state_bytes(pm), cuda=False)  # grads, optimizer state exist
            self._losses = 0
            self._forget()
            return self._timed("step", step, _whole)(*args, **kwargs)

        self._patch(pm, "step", timed_step)

    def _forget(self) -> None:
        """Drop the intervals of steps older than ``keep_steps``."""
        if len(self._steps) > self.keep_steps:
            keep = set(self._steps[-self.keep_steps :])
            self._intervals = [iv for iv in self._intervals if iv.step in keep]

    # -------------------------------------------------------------- results

    def record(self) -> RankRecord:
        """This rank's record so far (no communication)."""
        mesh = self.pmodel.mesh
        peak, method = self._mem.peak()
        return RankRecord(
            rank=mesh.rank,
            replica=mesh.replica,
            stage=mesh.stage,
            device=str(self.device),
            intervals=list(self._intervals),
            peak_bytes=peak,
            memory_method=method,
        )

    def gather(self) -> Measurement | None:
        """Every rank's record on rank 0 (a collective); None on the other ranks."""
        mine = self.record()
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world == 1:
            parts: list[Any] = [mine]
        else:
            rank = dist.get_rank()
            parts_or_none: list[Any] | None = [None] * world if rank == 0 else None
            dist.gather_object(mine, parts_or_none, dst=0)
            if rank != 0:
                return None
            assert parts_or_none is not None
            parts = parts_or_none
        recorded = sorted({iv.step for r in parts for iv in r.intervals if iv.kind == "step"})
        counted = [s for s in recorded if s >= self._first + self.warmup_steps] or recorded
        return Measurement(
            records=sorted(parts, key=lambda r: r.rank),
            steps=recorded,
            counted=counted,
            global_batch=self.pmodel.plan.global_batch,
        )

    def close(self) -> None:
        """Restore the wrapped methods and remove the hooks."""
        while self._undo:
            self._undo.pop()()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _whole(*args: Any, **kwargs: Any) -> int:
    return -1


def _state_bytes(pmodel: ParallelModel) -> int:
    """Bytes of the stage's parameters, buffers, gradients and optimizer state, each once."""
    module = pmodel.stage.module
    tensors: list[torch.Tensor] = [*module.parameters(), *module.buffers()]
    tensors += [p.grad for p in module.parameters() if p.grad is not None]
    if pmodel.optimizer is not None:
        for state in pmodel.optimizer.state.values():
            tensors += [t for t in state.values() if isinstance(t, torch.Tensor)]
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


class _MemoryProbe:
    """Peak memory of this rank's stage over the counted steps (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.state = 0
        self.base = 0
        self.reset = False

    def start(self, state_bytes: int, *, cuda: bool = True) -> None:
        """(Re)start: from here, the peak is ``state_bytes`` + the resident set's growth."""
        if self.device.type == "cuda":
            if cuda:  # max_memory_allocated counts everything: one reset, at the start
                torch.cuda.reset_peak_memory_stats(self.device)
            return
        self.state = state_bytes
        try:  # "5" resets the peak resident set size (VmHWM and ru_maxrss), Linux ≥ 4.0
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.reset = True
        except OSError:
            self.reset = False
        self.base = _rss_now() if self.reset else _rss_peak()

    def peak(self) -> tuple[float, str]:
        if self.device.type == "cuda":
            return float(torch.cuda.max_memory_allocated(self.device)), "cuda max allocated"
        grown = max(0, _rss_peak() - self.base)
        how = "cpu: stage tensors + peak RSS growth"
        return float(self.state + grown), how + ("" if self.reset else " (lower bound)")


def _rss_peak() -> int:
    kib_or_b = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(kib_or_b if sys.platform == "darwin" else kib_or_b * 1024)


def _rss_now() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return _rss_peak()


# --------------------------------------------------------------------------- reporting


def _err(measured: float, predicted: float) -> str:
    if not (predicted > 0) or measured != measured:  # nan
        return "—"
    return f"{(measured / predicted - 1) * 100:+.0f}%"


def _f(x: float, digits: int = 2) -> str:
    return "—" if x != x else f"{x:.{digits}f}"


def comparison_table(plan: Plan, result: Measurement) -> str:
    """The plan's predictions beside the measured figures, per stage, with the error of each.

    Error = measured / predicted − 1 (+25% : slower or larger than predicted).
    Times are per micro-batch (fwd, bwd) and per step; memory is the peak in
    MiB (see the module docstring for how it is measured on the CPU).
    """
    cols = [
        ("stage", 5),
        ("ranks", 6),
        ("fwd ms", 7),
        ("meas", 7),
        ("err", 6),
        ("bwd ms", 7),
        ("meas", 7),
        ("err", 6),
        ("step ms", 8),
        ("meas", 8),
        ("err", 6),
        ("mem MiB", 8),
        ("meas", 8),
        ("err", 6),
    ]
    warm = [s for s in result.steps if s not in set(result.counted)]
    lines = [
        f"predicted vs measured: {plan.schedule}, pp {plan.pp} × dp {plan.dp}, "
        f"{plan.micro_batches} micro-batches × {plan.micro_batch_size} samples; "
        f"medians over step(s) {_span(result.counted)}"
        + (f" (step(s) {_span(warm)}: warm-up)" if warm else ""),
        "  ".join(name.rjust(w) for name, w in cols),
    ]
    step_pred = float(plan.predicted.get("step_ms", float("nan")))
    # [Note: DDP's all-reduce runs inside the last backward] With dp > 1 the last
    # micro-batch's backward also all-reduces the stage's gradients (DDP hooks in
    # autograd). The backward column leaves it out when m > 1; with m = 1 it cannot,
    # and compares with the predicted backward + gradient sync instead (marked *).
    with_sync = plan.dp > 1 and plan.micro_batches == 1
    skip = plan.micro_batches if plan.dp > 1 and plan.micro_batches > 1 else None
    for st in plan.stages:
        got = result.stage_figures(st.index, skip_last_backward=skip)
        bwd_pred = st.bwd_ms + (st.sync_ms if with_sync else 0.0)
        mem_pred = float(st.memory.get("total", float("nan")))
        cells = [
            str(st.index),
            ",".join(map(str, st.ranks)),
            _f(st.fwd_ms),
            _f(got["fwd_ms"]),
            _err(got["fwd_ms"], st.fwd_ms),
            _f(bwd_pred) + ("*" if with_sync else ""),
            _f(got["bwd_ms"]),
            _err(got["bwd_ms"], bwd_pred),
            _f(step_pred, 1),
            _f(got["step_ms"], 1),
            _err(got["step_ms"], step_pred),
            _f(mem_pred / _MIB, 1),
            _f(got["peak_bytes"] / _MIB, 1),
            _err(got["peak_bytes"], mem_pred),
        ]
        lines.append("  ".join(c.rjust(w) for c, (_, w) in zip(cells, cols, strict=True)))
    sps_pred = float(plan.predicted.get("samples_per_s", float("nan")))
    lines.append(
        f"step: predicted {_f(step_pred, 1)} ms, measured {_f(result.step_ms, 1)} ms "
        f"({_err(result.step_ms, step_pred)}); throughput predicted {_f(sps_pred, 0)}, "
        f"measured {_f(result.samples_per_s, 0)} samples/s ({_err(result.samples_per_s, sps_pred)})"
    )
    if with_sync:
        lines.append("* backward + DDP gradient all-reduce (1 micro-batch, dp > 1)")
    elif skip:
        lines.append("backward: all but the last micro-batch's (which also all-reduces, dp > 1)")
    methods = sorted({r.memory_method for r in result.records})
    lines.append(f"memory measured as: {'; '.join(methods)}")
    return "\n".join(lines)


def _span(steps: list[int]) -> str:
    if not steps:
        return "none"
    lo, hi = steps[0] + 1, steps[-1] + 1  # 1-based, as the training log prints them
    return f"{lo}" if lo == hi else f"{lo}–{hi}"


# --------------------------------------------------------------------------- trace

_THREAD_STEP = 1000  # the "step" lane's thread id, below the stage lane


def trace_json(result: Measurement, *, title: str = "measured") -> dict[str, Any]:
    """The recorded intervals as Chrome / Perfetto trace JSON, one process per rank.

    The same format as ``planner.report.trace_events`` (the predicted trace):
    complete ("X") events in microseconds, named "F3" / "B3" on a thread
    "stage k", so a predicted and a measured trace read alike. Each rank's
    process also has a "steps" lane (the step, the optimizer, the tied sum).
    """
    events: list[dict[str, Any]] = []
    t0 = min((iv.start for r in result.records for iv in r.intervals), default=0.0)
    for r in result.records:
        pid = r.rank
        events += [
            _meta(
                "process_name", pid, 0, name=f"rank {r.rank}: replica {r.replica}, stage {r.stage}"
            ),
            _meta("process_sort_index", pid, 0, sort_index=r.rank),
            _meta("thread_name", pid, r.stage, name=f"stage {r.stage}"),
            _meta("thread_sort_index", pid, r.stage, sort_index=0),
            _meta("thread_name", pid, _THREAD_STEP, name="steps"),
            _meta("thread_sort_index", pid, _THREAD_STEP, sort_index=1),
        ]
        for iv in r.intervals:
            lane = r.stage if iv.kind in ("F", "B", "loss") else _THREAD_STEP
            name = f"{iv.kind}{iv.micro_batch}" if iv.micro_batch >= 0 else iv.kind
            if iv.kind == "step":
                name = f"step {iv.step + 1}"
            args: dict[str, Any] = {"stage": r.stage, "step": iv.step + 1}
            if iv.micro_batch >= 0:
                args["micro_batch"] = iv.micro_batch
            events.append(
                {
                    "name": name,
                    "cat": iv.kind,
                    "ph": "X",
                    "pid": pid,
                    "tid": lane,
                    "ts": round((iv.start - t0) * 1e6, 3),
                    "dur": round((iv.end - iv.start) * 1e6, 3),
                    "args": args,
                }
            )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"title": title, "steps": [s + 1 for s in result.steps]},
    }


def _meta(what: str, pid: int, tid: int, **args: Any) -> dict[str, Any]:
    return {"name": what, "ph": "M", "pid": pid, "tid": tid, "args": args}


def write_trace(
    result: Measurement, path: str | os.PathLike[str], *, title: str = "measured"
) -> Path:
    """Write :func:`trace_json` to ``path`` atomically; open it in ui.perfetto.dev."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(trace_json(result, title=title), f, ensure_ascii=False)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
