"""The plan's precision, run as priced: ``fp32``, or ``bf16-mixed`` (autocast to bfloat16).

[Note: bf16-mixed as it runs]
What runs, and what the cost model (``planner.cost.basis.state_bytes``) prices:

* parameters stay fp32: they are the master weights the optimizer steps;
* every stage's forward (its recomputed forward too) and the loss run under
  ``torch.autocast(device, dtype=torch.bfloat16)``, one autocast region per
  step around the whole schedule, so each weight is cast to bf16 once per step
  (autocast's cache) and that copy lives until the step's backward ends;
* activations are what autocast's ops make (bf16 for matmuls and convolutions,
  fp32 where autocast keeps fp32, e.g. a loss), and they cross the split
  points in that dtype: the stages' receive buffers are retyped to the dtypes
  one autocast forward of the example gives (:func:`retype_boundaries`);
* gradients are fp32 (they flow back to fp32 leaves); DDP all-reduces them
  in bf16 on the wire (torch's ``bf16_compress_hook``: half the bytes), into
  fp32 buckets; a stage that averages its gradients by hand (the zero-bubble
  schedules, ``runtime.zero_bubble``) sends them in bf16 too
  (:func:`mean_all_reduce`).

So with Adam a parameter costs 4 (fp32 weight) + 2 (its bf16 copy) + 4
(gradient) + 8 (two moments) bytes at the peak.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from planner.plan.schema import Plan
from runtime.options import LEARNING_RATES
from runtime.wrapper import StageWrapper

__all__ = [
    "PRECISIONS",
    "autocast",
    "check_training",
    "compress_gradients",
    "mean_all_reduce",
    "retype_boundaries",
    "send_as",
]

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "bf16-mixed")
"""The precisions this runtime executes (the planner prices the same two)."""


def check_training(plan: Plan) -> None:
    """Refuse a plan whose precision or optimizer this runtime does not run.

    Example::

        check_training(load_plan("plan.yaml"))   # before building anything

    Raises:
        ValueError: ``training.precision`` or ``training.optimizer`` is not one
            this runtime implements; the message names both the value and the choices.
    """
    tr = plan.training
    if tr.precision not in PRECISIONS:
        raise ValueError(
            f"the plan's training.precision is {tr.precision!r}, which this runtime does not "
            f"run (it runs {', '.join(PRECISIONS)}); the plan's memory and time were priced "
            "for it, so running another precision would not do what the plan says.\n  fix: "
            f"re-plan with --precision {PRECISIONS[0]} or {PRECISIONS[1]}"
        )
    if tr.optimizer not in LEARNING_RATES:
        built = ", ".join(LEARNING_RATES)
        raise ValueError(
            f"the plan's training.optimizer is {tr.optimizer!r}, which this runtime does not "
            f"build (it builds {built}); its optimizer state was priced for it.\n  fix: "
            f"re-plan with --optimizer one of {built}"
        )


@contextlib.contextmanager
def autocast(plan: Plan, device: torch.device) -> Iterator[None]:
    """The step's autocast region: bf16 autocast for ``bf16-mixed``, nothing for ``fp32``.

    Example::

        with autocast(plan, mesh.device):
            schedule.step(x, target=y, losses=losses)   # forward, loss and backward
    """
    if plan.precision != "bf16-mixed":
        yield
        return
    with torch.autocast(device.type, dtype=torch.bfloat16):
        yield


def compress_gradients(wrapped: nn.Module, plan: Plan, group: Any) -> bool:
    """For ``bf16-mixed``: DDP all-reduces gradients in bf16 (half the bytes); True if set.

    The hook is torch's ``bf16_compress_hook``, written out: torch's own refuses
    every backend but NCCL and XCCL, and gloo reduces bf16 as well.
    """
    from torch.nn.parallel import DistributedDataParallel

    if plan.precision != "bf16-mixed" or not isinstance(wrapped, DistributedDataParallel):
        return False
    wrapped.register_comm_hook(group, _bf16_allreduce)
    return True


def mean_all_reduce(flat: torch.Tensor, group: Any, plan: Plan) -> None:
    """``flat`` ← its mean over ``group``, in place; on the wire in bf16 where the plan is
    ``bf16-mixed`` and ``flat`` is fp32, as DDP's hook (:func:`compress_gradients`) sends
    it and the cost model prices it."""
    import torch.distributed as dist

    n = dist.get_world_size(group)
    if plan.precision == "bf16-mixed" and flat.dtype == torch.float32:
        wire = flat.to(torch.bfloat16).div_(n)
        dist.all_reduce(wire, group=group)
        flat.copy_(wire)
    else:
        dist.all_reduce(flat, group=group)
        flat.div_(n)


def _bf16_allreduce(group, bucket):  # unannotated: DDP checks a hook's annotations
    """A DDP communication hook: the bucket's mean over the group, reduced in bf16."""
    import torch.distributed as dist

    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return future.then(decompress)


# --------------------------------------------------------------------------- boundaries


def retype_boundaries(
    parts: Any, example: Any, plan: Plan, device: torch.device
) -> list[tuple[torch.dtype | None, ...]]:
    """Give every stage's received and sent tensors the dtypes they have under autocast.

    The split traced the model in fp32, so torch's stages would allocate fp32
    receive buffers for activations autocast makes in bf16. One forward of the
    example micro-batch under the plan's autocast (no grad; RNG and buffers
    restored; on the CPU, where the model is) records each stage's inputs and
    outputs; the dtypes of the ``pipeline`` stages' graph metadata (what
    ``_PipelineStage`` reads) or of the ``fx`` path's example tensors are set
    from it. Nothing to do for fp32.

    Returns:
        For each stage, the dtype each of its outputs is sent in (None: not a
        floating tensor, or the last stage's): what :class:`SendAs` casts to, so
        that what is sent always matches what the next stage allocated, even
        where the device's autocast picks another dtype than the CPU's.
    """
    if plan.precision != "bf16-mixed":
        return [() for _ in parts.modules]
    seen = _autocast_boundaries(parts, example, plan, device)
    if parts.pipe is not None:
        for mod, (ins, outs) in zip(parts.modules, seen, strict=True):
            _retype_graph(mod.graph, ins, outs)
    else:
        parts.shapes = [
            (_retyped(ins, got_in), _retyped(outs, got_out))
            for (ins, outs), (got_in, got_out) in zip(parts.shapes, seen, strict=True)
        ]
    changed = sum(
        t.dtype != torch.float32 for ins, outs in seen for t in (*ins, *outs) if t is not None
    )
    log.info("bf16-mixed: %d stage boundary tensor(s) travel in another dtype than fp32", changed)
    last = len(seen) - 1
    return [
        tuple(
            t.dtype if t is not None and t.is_floating_point() and k < last else None for t in outs
        )
        for k, (_, outs) in enumerate(seen)
    ]


class SendAs(StageWrapper):
    """``module`` whose floating outputs are cast to the dtypes the next stage receives.

    A no-op where the dtypes already agree (always on the CPU, where they were
    measured); elsewhere it keeps the wire consistent with the receive buffers.
    The cast is differentiable: the gradient comes back in the output's dtype.
    """

    def __init__(self, module: nn.Module, dtypes: tuple[torch.dtype | None, ...]) -> None:
        super().__init__(module)
        self.dtypes = dtypes

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.module(*args, **kwargs)
        leaves, spec = pytree.tree_flatten(out)
        cast = [
            t.to(d) if isinstance(t, torch.Tensor) and d is not None and t.dtype != d else t
            for t, d in zip(leaves, self.dtypes, strict=False)
        ]
        return pytree.tree_unflatten(cast + leaves[len(cast) :], spec)


def send_as(module: nn.Module, dtypes: tuple[torch.dtype | None, ...]) -> nn.Module:
    """``SendAs(module, dtypes)`` when some output has a dtype to keep, else ``module``."""
    return SendAs(module, dtypes) if any(d is not None for d in dtypes) else module


def _autocast_boundaries(
    parts: Any, example: Any, plan: Plan, device: torch.device
) -> list[tuple[list[torch.Tensor | None], list[torch.Tensor | None]]]:
    """Each stage's (inputs, outputs) tensors in one autocast forward of ``example``."""
    args, kwargs = example
    seen: list[tuple[list[torch.Tensor | None], list[torch.Tensor | None]]] = []

    def leaves(obj: Any) -> list[torch.Tensor | None]:
        return [t if isinstance(t, torch.Tensor) else None for t in pytree.tree_leaves(obj)]

    pipe = parts.pipe
    buffers = [b for m in parts.modules for b in m.buffers()]
    saved = [(b, b.detach().clone()) for b in buffers]
    with torch.no_grad(), torch.random.fork_rng(devices=[]), autocast(plan, device):
        try:
            if pipe is not None:
                handles = []
                for mod in parts.modules:

                    def hook(_m: nn.Module, a: Any, kw: Any, out: Any) -> None:
                        seen.append((leaves((a, kw)), leaves(out)))

                    handles.append(mod.register_forward_hook(hook, with_kwargs=True))
                try:
                    pipe(*args, **kwargs)  # torch's Pipe runs its stages in order
                finally:
                    for h in handles:
                        h.remove()
            else:
                out: Any = parts.modules[0](*args, **kwargs)
                seen.append((leaves((args, kwargs)), leaves(out)))
                for mod in parts.modules[1:]:
                    inputs = tuple(out)
                    out = mod(*inputs)
                    seen.append((leaves(inputs), leaves(out)))
        finally:
            for b, v in saved:
                b.copy_(v)
    if len(seen) != len(parts.modules):
        raise RuntimeError(
            f"an autocast forward of the example ran {len(seen)} stage calls for "
            f"{len(parts.modules)} stages; the split's stages must each run once"
        )
    return seen


def _retype_graph(
    graph: torch.fx.Graph, ins: list[torch.Tensor | None], outs: list[torch.Tensor | None]
) -> None:
    """Set the placeholders' and the output's ``meta["val"]`` dtypes to those seen."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    tensors_in = [t for t in ins if t is not None]
    for node, seen in zip(placeholders, tensors_in, strict=False):
        _retype_node(node, seen)
    output = graph.output_node()
    nodes = [a for a in pytree.tree_leaves(output.args) if isinstance(a, torch.fx.Node)]
    for node, seen in zip(nodes, [t for t in outs if t is not None], strict=False):
        _retype_node(node, seen)


def _retype_node(node: torch.fx.Node, seen: torch.Tensor) -> None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype == seen.dtype:
        return
    if not (val.is_floating_point() and seen.is_floating_point()):
        return
    with contextlib.suppress(Exception), torch._subclasses.fake_tensor.unset_fake_temporarily():
        node.meta["val"] = torch.empty_strided(
            tuple(val.shape), tuple(val.stride()), dtype=seen.dtype, device="meta"
        )


def _retyped(examples: Any, seen: list[torch.Tensor | None]) -> Any:
    """The fx path's example tensors with the dtypes seen under autocast."""
    got = [t for t in seen if t is not None]
    out = []
    for k, t in enumerate(examples):
        if k < len(got) and t.is_floating_point() and got[k].is_floating_point():
            t = t.detach().to(got[k].dtype).requires_grad_(t.requires_grad)
        out.append(t)
    return tuple(out)
