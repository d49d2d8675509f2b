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
  *outside* these calls, so waiting is not counted as work); under the
  zero-bubble schedules ``backward_one_chunk`` is the backward's input part
  and ``backward_weight_one_chunk`` (``W k``) its weights' part, counted
  together as the micro-batch's backward. On the last
  stage the loss (the schedule's ``_loss_fn``, when present) is timed too and
  counted in the forward, as the planner's prediction counts it;
* ``ParallelModel.step``: the step's wall time; the optimizer's step through
  its public pre/post hooks; the tied-weight gradient sum.

On CUDA each timed interval is bracketed by ``torch.cuda.synchronize`` (the
kernels are asynchronous), which costs some overlap: measure, then train
without the recorder. Peak memory over the counted steps:
``torch.cuda.max_memory_allocated`` on CUDA; on the CPU (no allocator
statistics) the peak of live tensor bytes, counted storage by storage as the
steps allocate and free them (``runtime.measure.live``): parameters,
gradients, optimizer state, buffers, activations, the pipeline's receive
buffers, DDP's buckets. Its cost is one Python call per operator (see
[Note: tracking live tensor bytes]): +2 % on examples/mlp.py's step, +30-55 % on
examples/unet.py's, whose Adam step took 3-5 times as long (many small tensors,
19 operators each). So on the CPU the peak is measured over the first
``memory_steps`` steps after warm-up only, and the times come from the steps
after them, untracked (``Measurement.memory_steps``, ``Measurement.counted``);
a run too short to have any untracked step times its tracked ones, and
``comparison_table`` says so.

The first ``warmup_steps`` recorded steps (allocations, first-call costs) are
left out of the figures. Ranks' clocks are aligned by a barrier when the
recorder starts (good to about a millisecond on one machine).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from planner.plan.measured import Interval, Measurement, RankRecord
from runtime.measure.memory import MemoryProbe

if TYPE_CHECKING:
    from runtime.engine import ParallelModel

__all__ = ["MEMORY_STEPS", "Interval", "Measurement", "RankRecord", "Recorder"]

log = logging.getLogger(__name__)

MEMORY_STEPS = 2
"""CPU: steps after warm-up whose peak memory is measured (tracked, so not timed).
Two: a steady step's peak, and a check that the next one's is the same size."""


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
        memory: measure peak memory too; without it (``--no-memory``) nothing is
            tracked on the CPU, and the peak is NaN.
        memory_steps: on the CPU, the steps after warm-up whose peak memory is
            measured; they are left out of the times when later steps exist.
    """

    def __init__(
        self,
        pmodel: ParallelModel,
        *,
        warmup_steps: int = 1,
        keep_steps: int = 50,
        first_step: int = 0,
        memory: bool = True,
        memory_steps: int = MEMORY_STEPS,
    ):
        if warmup_steps < 0 or keep_steps < 1 or memory_steps < 1:
            raise ValueError(
                "warmup_steps must be ≥ 0, keep_steps and memory_steps ≥ 1, got "
                f"{warmup_steps}, {keep_steps}, {memory_steps}"
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
        self._mem = MemoryProbe(self.device) if memory else None
        # The CPU's tracking slows the steps it runs in: they end here, and are not timed.
        tracked_cpu = memory and self.device.type != "cuda"
        self._mem_end = first_step + warmup_steps + memory_steps if tracked_cpu else None
        self._wrap()
        if dist.is_initialized() and self._sync:
            dist.barrier(device_ids=[self.device.index])
        elif dist.is_initialized():
            dist.barrier()
        self._t0 = time.perf_counter()
        if self._mem is not None:
            self._mem.start([st.wrapped for st in pmodel.stages])

    # -------------------------------------------------------------- wrapping

    def _clock(self) -> float:
        if self._sync:
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self._t0

    def _timed(
        self, kind: str, fn: Callable[..., Any], mb_of: Callable[..., int], stage: int = -1
    ) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = self._clock()
            try:
                return fn(*args, **kwargs)
            finally:
                mb = mb_of(*args, **kwargs)
                iv = Interval(kind, self._step, mb, start, self._clock(), stage)
                self._intervals.append(iv)

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

        def chunk(*args: Any, **kwargs: Any) -> int:
            for key in ("fwd_chunk_id", "bwd_chunk_id"):
                if key in kwargs:
                    return int(kwargs[key])
            return int(args[0]) if args else -1

        several = len(pm.stages) > 1  # intervals say their stage (v > 1)
        for st in pm.stages:
            stage, at = st.pipeline_stage, st.index if several else -1
            forward, backward = stage.forward_one_chunk, stage.backward_one_chunk
            self._patch(stage, "forward_one_chunk", self._timed("F", forward, chunk, at))
            self._patch(stage, "backward_one_chunk", self._timed("B", backward, chunk, at))
            w_part = "backward_weight_one_chunk"  # zero-bubble's W (pp 1's Accumulate: none)
            if hasattr(stage, w_part):
                self._patch(stage, w_part, self._timed("W", getattr(stage, w_part), chunk, at))
        loss_fn = getattr(pm.schedule, "_loss_fn", None)  # private: timed when present
        if callable(loss_fn):

            def loss_mb(*args: Any, **kwargs: Any) -> int:
                self._losses += 1  # the schedule computes the losses in micro-batch order
                return self._losses - 1

            last = pm.mesh.num_stages - 1 if several else -1
            self._patch(pm.schedule, "_loss_fn", self._timed("loss", loss_fn, loss_mb, last))
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
        cpu_tracked = self._mem is not None and self.device.type != "cuda"
        for ddp in (st.wrapped for st in pm.stages):
            if isinstance(ddp, DistributedDataParallel) and cpu_tracked:
                assert self._mem is not None
                self._patch(ddp, "_pre_forward", self._mem.untracked_ddp(ddp._pre_forward))
        step = pm.step

        def timed_step(*args: Any, **kwargs: Any) -> Any:
            self._step += 1
            self._steps.append(self._step)
            if self._step == self._first + self.warmup_steps and self._mem is not None:
                self._mem.count_from_here()  # grads, optimizer state exist now
            self._losses = 0
            self._forget()
            if self._mem is None or (self._mem_end is not None and self._step >= self._mem_end):
                return self._timed("step", step, _whole)(*args, **kwargs)
            with self._mem.step((args, kwargs)):
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
        peak, method = (float("nan"), "not measured (--no-memory)")
        if self._mem is not None:
            peak, method = self._mem.peak()
        return RankRecord(
            rank=mesh.rank,
            replica=mesh.replica,
            stage=mesh.stage,
            device=str(self.device),
            intervals=tuple(self._intervals),
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
        after = [s for s in recorded if s >= self._first + self.warmup_steps] or recorded
        memory_steps = after if self._mem is not None else []
        if self._mem_end is not None:
            memory_steps = [s for s in after if s < self._mem_end]
        counted = [s for s in after if s not in memory_steps] or after
        return Measurement(
            records=tuple(sorted(parts, key=lambda r: r.rank)),
            steps=tuple(recorded),
            counted=tuple(counted),
            global_batch=self.pmodel.plan.global_batch,
            memory_steps=tuple(memory_steps),
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
