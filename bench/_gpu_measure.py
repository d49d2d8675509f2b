"""Step (b) of bench/gpu_check.sh: every block of the analytic profile timed on a device.

[Note: measured on the GPU]
`planner profile` measures on the CPU only: it builds the model and batch there, its
timers do not synchronize CUDA, and its whole-model round makes the output gradients on
the CPU (planner/profile/timing.py, _Rounds._whole). So step (b) times the analytic
profile's own blocks itself, on the model moved to the device. A block runs from its
split point's module call to the next one's. Forward: a mark at each split module's call
(a forward pre-hook). Backward: a mark when the gradient of a split module's inputs is
complete (hooks on those tensors), where that block's backward ends; a block none of
whose inputs needs a gradient gets no mark, and its backward is counted in the block
before it ("merged"). Marks are CUDA events on a GPU, host timers on the CPU. Eager
execution: a block of small kernels is timed with the GPU waiting for their launches, as
the runtime runs it; the runs of step (d) time with torch.cuda.synchronize around each
interval (runtime.measure.recorder). Memory: the bytes autograd saves, each storage once,
charged to the block whose op made it (parameters and the batch are made by none): what
the planner calls activation_bytes.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from bench._gpu_compare import Round, measured_record, report, totals
from planner.plan.modelfile import ModelFile, load_model_file
from planner.plan.records import ModelProfile

__all__ = ["BlockMarks", "Workload", "measure", "rounds_of", "saved_bytes"]

Key = tuple[str, int]  # ("F", k): block k's forward starts; ("B", k): its backward ends


class BlockMarks:
    """The marks of one round, (key, CUDA event or host time) in the order they happen,
    and the block running now (for :func:`saved_bytes`)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.marks: list[tuple[Key, Any]] = []
        self.block = 0
        self.timing = False

    def mark(self, key: Key) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((key, event))
        else:
            self.marks.append((key, time.perf_counter()))

    def on_grad(self, key: Key) -> Callable[[torch.Tensor], None]:
        """A tensor hook: marks ``key`` when the tensor's gradient is complete."""
        return lambda grad: self.mark(key)

    def pre_hook(self, k: int) -> Callable[[torch.nn.Module, Any], None]:
        """A forward pre-hook for block ``k``'s split module."""

        def hook(module: torch.nn.Module, inputs: Any) -> None:
            self.block = k
            if self.timing:
                self.mark(("F", k))
                for t in needing_grad(inputs):
                    t.register_hook(self.on_grad(("B", k)))

        return hook

    def times(self) -> dict[Key, float]:
        """Each key's ms since the first mark (the last mark of a key wins)."""
        if self.cuda:
            torch.cuda.synchronize()
            first = self.marks[0][1]
            return {key: first.elapsed_time(e) for key, e in self.marks}
        return {key: (t - self.marks[0][1]) * 1e3 for key, t in self.marks}


def needing_grad(x: Any) -> list[torch.Tensor]:
    """The tensors in ``x`` (any nesting) that need a gradient."""
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor) and t.requires_grad]


@dataclass
class Workload:
    """The model on its device, one micro-batch there, and the model file's loss."""

    mf: ModelFile
    model: torch.nn.Module
    args: Any
    kwargs: Any
    targets: Any
    n: int  # blocks of the analytic profile
    marks: BlockMarks

    def one_round(self) -> Round:
        """Forward, loss, backward once; the ms of each block, the loss and the whole."""
        n, marks = self.n, self.marks
        marks.marks.clear()
        self.model.zero_grad(set_to_none=True)
        marks.timing, marks.block = True, 0
        marks.mark(("F", 0))
        out = self.model(*self.args, **self.kwargs)
        marks.mark(("F", n))
        for t in needing_grad(out):
            t.register_hook(marks.on_grad(("B", n)))  # the loss's backward ends there
        loss = self.mf.loss(out, self.targets)
        marks.mark(("L", 0))
        loss.backward()
        marks.mark(("B", 0))
        marks.timing = False
        at = marks.times()
        fwd = [at[("F", k + 1)] - at[("F", k)] for k in range(n)]
        bwd = [math.nan] * n
        upper = at[("B", n)]
        for k in range(n - 1, -1, -1):
            if ("B", k) in at:
                bwd[k], upper = at[("B", k)] - upper, at[("B", k)]
        return {
            "fwd": fwd,
            "bwd": bwd,
            "loss_fwd": at[("L", 0)] - at[("F", n)],
            "loss_bwd": at[("B", n)] - at[("L", 0)],
            "whole": at[("B", 0)] - at[("F", 0)],
        }


def rounds_of(work: Workload) -> list[Round]:
    """5 warm-up rounds (allocator, kernel selection, lazy initialization), then 10 or
    more, for 1 s or more (20 s at most)."""
    rounds: list[Round] = []
    started = time.perf_counter()
    for r in range(80):
        got = work.one_round()
        if r < 5:
            started = time.perf_counter()
            continue
        rounds.append(got)
        spent = time.perf_counter() - started
        if (len(rounds) >= 10 and spent >= 1.0) or spent >= 20.0:
            break
    return rounds


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage (a sparse tensor, say)
        return None


class _Maker(TorchDispatchMode):
    """Every new storage an op makes, charged to the block running (a view is no new one)."""

    def __init__(self, marks: BlockMarks) -> None:
        super().__init__()
        self.marks = marks
        self.made: dict[int | None, int] = {}

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        given = {_storage(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and _storage(t) not in given:
                self.made[_storage(t)] = self.marks.block  # the allocator reuses addresses
        return out


def saved_bytes(work: Workload) -> list[int]:
    """One more forward: the bytes autograd saves, each storage once, per block that made it."""
    saved = [0] * work.n
    seen: set[int] = set()
    maker = _Maker(work.marks)

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage(t)
        if key is not None and key not in seen:
            seen.add(key)
            if maker.made.get(key) is not None:
                saved[maker.made[key]] += t.untyped_storage().nbytes()
        return t

    work.marks.block = 0
    with maker, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = work.model(*work.args, **work.kwargs)
    del out
    return saved


def _workload(model_file: str, where: str, micro_batch: int, an: ModelProfile) -> Workload:
    device = torch.device(where)
    mf = load_model_file(model_file)
    torch.manual_seed(0)
    model = mf.build().to(device)  # .to keeps a tied weight one Parameter
    batch = mf.sample(micro_batch)

    def moved(x: Any) -> Any:
        return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, x)

    modules = dict(model.named_modules())
    unknown = [b.name for b in an.blocks[1:] if b.name not in modules]
    if unknown:
        raise SystemExit(
            f"error: the analytic profile's split points {unknown} are no modules of this "
            "model: it was profiled with other GPT_* settings; run both steps with the same ones"
        )
    marks = BlockMarks(cuda=device.type == "cuda")
    for k in range(1, len(an.blocks)):
        modules[an.blocks[k].name].register_forward_pre_hook(marks.pre_hook(k))
    args, kwargs, targets = moved(batch.args), moved(batch.kwargs), moved(batch.targets)
    return Workload(mf, model, args, kwargs, targets, len(an.blocks), marks)


def measure(
    model_file: str,
    where: str,
    micro_batch: int,
    analytic_path: str,
    out_path: str,
    compare_path: str,
) -> None:
    """Time the blocks of the analytic profile at ``analytic_path`` on ``where``
    ("cuda:0", "cpu"), write ``out_path`` (the measured profile) and ``compare_path``
    (the totals, for the summary), and print both profiles side by side.

    Raises:
        SystemExit: the profile's split points are no modules of the model built here.
    """
    with open(analytic_path) as f:
        an = ModelProfile.from_dict(json.load(f), path=analytic_path)
    work = _workload(model_file, where, micro_batch, an)
    rounds = rounds_of(work)
    saved = saved_bytes(work)
    how = "split-point hooks, CUDA events" if work.marks.cuda else "split-point hooks, host timers"
    measured = measured_record(
        an, where=where, how=how, micro_batch=micro_batch, rounds=rounds, saved=saved
    )
    report(
        an,
        measured,
        totals(an, rounds, saved),
        out_path=out_path,
        compare_path=compare_path,
    )
