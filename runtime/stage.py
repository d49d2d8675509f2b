"""This rank's pipeline stages: the model split at the plan's split points, DDP over replicas.

One stage per rank (v = 1), or ``v`` (Interleaved 1F1B, Looped BFS: the stages
``plan.stage_ranks`` places on this rank's pipeline position), each its own
torch stage object, each DDP-wrapped on its own.

The split is :mod:`runtime.split`'s: ``pipeline`` (torch.export underneath,
then ``pipe.build_stage``), or ``fx`` (a ``symbolic_trace`` graph and a manual
``PipelineStage`` with the example shapes measured there).

Every rank splits the whole model (deterministically), so every rank knows
which stage holds which parameter: tied-weight groups need that. The split
needs names and shapes only: a model built with its parameters on the meta
device is split the same way, and only this rank's stage is then given storage
(``--init-from``, :mod:`runtime.materialize`). Each rank keeps only its own
stage; names a stage module carries but never uses (e.g. the untouched original
of a tied weight that ``pipeline`` copies) are removed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.fx
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.nn.parallel import DistributedDataParallel

from planner.plan.schema import Plan
from runtime.fsdp import is_sharded, shard_stage
from runtime.mesh import Mesh
from runtime.options import SPLIT_METHODS
from runtime.precision import retype_boundaries, send_as
from runtime.recompute import maybe_recompute
from runtime.split import Example, StageError, split_for_plan
from runtime.split.used import prune_unused, release_others, used_tensors
from runtime.zero_bubble import detachable, reduce_by_hand, reduces_by_hand, skip_self_warmup

__all__ = ["StageModule", "build_stage", "build_stages", "maybe_ddp", "rank_module", "replicate"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class StageModule:
    """This rank's stage, ready for a schedule.

    Attributes:
        index: the stage index; ``num_stages`` the model's stages (pp · v).
        module: the stage's submodule; its parameters and buffers keep the
            model's FQNs (``blocks.3.attn.qkv.weight``).
        wrapped: ``DistributedDataParallel(module)`` when dp > 1 and the stage
            has trainable parameters; with ``dp_mode: fsdp`` the module itself
            made an FSDP unit (``runtime.fsdp``); else ``module``.
        pipeline_stage: torch's stage object the schedule runs.
        method: how the model was split: "pipeline" or "fx".
        fallback_reason: why ``pipeline`` was not used (None when it was).
        held: for every stage (not only this one), the names of the parameters
            and buffers its module keeps, all aliases included.
        restore: the last stage's output → what the model returns (what the
            loss takes: the same object as in one process).
    """

    index: int
    num_stages: int
    module: nn.Module
    wrapped: nn.Module
    pipeline_stage: Any
    method: str
    fallback_reason: str | None
    held: tuple[frozenset[str], ...]
    restore: Callable[[Any], Any]

    @property
    def ddp(self) -> bool:
        return isinstance(self.wrapped, DistributedDataParallel)

    @property
    def fsdp(self) -> bool:
        """Whether the replicas shard this stage (``runtime.fsdp``)."""
        return is_sharded(self.wrapped)

    def trainable(self) -> list[nn.Parameter]:
        """This stage's parameters that require grad, each tensor once."""
        return [p for p in self.module.parameters() if p.requires_grad]


# --------------------------------------------------------------------------- build


def build_stage(
    model: nn.Module,
    plan: Plan,
    mesh: Mesh,
    example: Example,
    *,
    split: str = "auto",
    materialize: Callable[[nn.Module, torch.device], None] | None = None,
) -> StageModule:
    """Split ``model`` as ``plan`` says and build this rank's stage (DDP-wrapped if dp > 1).

    Example::

        stage = build_stage(model, plan, mesh, ((x[:4],), {}))
        schedule = ScheduleGPipe(stage.pipeline_stage, plan.micro_batches, loss_fn=loss)

    One stage per rank (v = 1); :func:`build_stages` builds this rank's several.
    Arguments and errors as :func:`build_stages`'s.
    """
    stages = build_stages(model, plan, mesh, example, split=split, materialize=materialize)
    if len(stages) != 1:
        raise ValueError(
            f"this rank runs {len(stages)} stages ({list(mesh.stages)}: the plan has "
            f"{plan.virtual} stages per pipeline rank); build them with build_stages"
        )
    return stages[0]


def build_stages(
    model: nn.Module,
    plan: Plan,
    mesh: Mesh,
    example: Example,
    *,
    split: str = "auto",
    materialize: Callable[[nn.Module, torch.device], None] | None = None,
) -> tuple[StageModule, ...]:
    """Split ``model`` as ``plan`` says and build this rank's stages (each DDP-wrapped if dp > 1).

    Example::

        stages = build_stages(model, plan, mesh, ((x[:4],), {}))   # v = 2: stages 0 and 2
        schedule = ScheduleInterleaved1F1B([s.pipeline_stage for s in stages], 4, loss_fn=loss)

    Args:
        model: the whole model, the same (same initial values) on every rank.
            Its stages share tensors with it (no copies on the CPU).
        example: ONE micro-batch's ``(args, kwargs)``, of the plan's micro-batch
            size: ``pipeline`` traces static shapes.
        split: one of :data:`SPLIT_METHODS`.
        materialize: ``materialize(stage_module, device)`` gives a meta-built stage
            storage and values (``runtime.materialize.StageWeights``).

    Returns:
        This rank's stages (``mesh.stages``), in model order: one when v = 1.

    Raises:
        StageError: the split does not give the plan's pp · v stages, both ways
            to split failed (the message says why each did), or two stages of
            this rank share a tensor (see :func:`_check_unshared`).
    """
    if split not in SPLIT_METHODS:
        raise ValueError(f"split must be one of {', '.join(SPLIT_METHODS)}, got {split!r}")
    parts = split_for_plan(model, plan, example, split)
    sends = retype_boundaries(parts, example, plan, mesh.device)  # bf16-mixed: autocast's dtypes
    used = [used_tensors(m) for m in parts.modules]
    held = tuple(frozenset(names) for names in used)
    mine = [parts.modules[s] for s in mesh.stages]
    for s, module in zip(mesh.stages, mine, strict=True):
        prune_unused(module, used[s])
    _check_unshared(mine, mesh, parts.method)
    if materialize is not None:  # [Note: building a stage without the whole model]
        for module in mine:
            materialize(module, mesh.device)
    stages = [_torch_stage(parts, s, plan, mesh) for s in mesh.stages]
    if parts.pipe is not None:  # torch's stage keeps the Pipe's graph, and all stages with it
        release_others([parts.pipe.split_gm], keep=mine)  # (export's modules: the model's stay)
    out = []
    for s, module, stage in zip(mesh.stages, mine, stages, strict=True):
        # [Note: recompute as it runs] in runtime.recompute
        runner = maybe_recompute(send_as(module, sends[s]), plan.stages[s].recompute)
        wrapped = replicate(detachable(runner, plan.schedule), mesh, plan)
        stage.submod = wrapped
        reduce_by_hand(stage, module, mesh, plan)  # [Note: DDP under a split backward]
        log.info(
            "%s stage %d/%d built with %s: %d parameters (%d trainable), %s",
            mesh.prefix,
            s,
            len(plan.stages),
            parts.method,
            sum(1 for _ in module.parameters()),
            sum(p.numel() for p in module.parameters() if p.requires_grad),
            _replication(wrapped, mesh, plan),
        )
        out.append(
            StageModule(
                index=s,
                num_stages=len(plan.stages),
                module=module,
                wrapped=wrapped,
                pipeline_stage=stage,
                method=parts.method,
                fallback_reason=parts.reason,
                held=held,
                restore=parts.restore,
            )
        )
    return tuple(out)


def _replication(wrapped: nn.Module, mesh: Mesh, plan: Plan) -> str:
    """How the stage's replicas keep their gradients in step, for the build's log."""
    if is_sharded(wrapped):
        return "FSDP"
    if isinstance(wrapped, DistributedDataParallel):
        return "DDP"
    if reduces_by_hand(plan, mesh.dp):
        return "gradients averaged by hand (a split backward: no DDP)"
    return "no DDP"


def _torch_stage(parts: Any, s: int, plan: Plan, mesh: Mesh) -> Any:
    """torch's stage object for stage ``s`` of this rank, talking to its replica's stages."""
    n = len(plan.stages)
    if parts.pipe is not None:
        stage = parts.pipe.build_stage(s, mesh.device, group=mesh.pp_group)
    else:
        ins, outs = parts.shapes[s]
        stage = PipelineStage(
            parts.modules[s], s, n, mesh.device, input_args=ins, output_args=outs,
            group=mesh.pp_group,
        )  # fmt: skip
    # The pp group's ranks are sorted by global rank; the plan's stage order may differ.
    stage.stage_index_to_group_rank = {
        i: dist.get_group_rank(mesh.pp_group, mesh.rank_of(mesh.replica, i)) for i in range(n)
    }
    skip_self_warmup(stage)
    return stage


def _check_unshared(modules: list[nn.Module], mesh: Mesh, method: str) -> None:
    """Refuse two stages of this rank holding one tensor (a tied weight the ``fx`` split shares).

    torch scales each stage's gradients by 1/m after its last backward, and DDP
    reduces each stage's own parameters: one tensor in two of this rank's stages
    would be scaled twice and reduced twice. ``pipeline`` gives every stage its
    own copy of a tied weight (``runtime.tied`` sums their gradients); the ``fx``
    split shares the model's tensor, which is only a problem when two stages
    using it run on one rank.
    """
    owner: dict[int, tuple[int, str]] = {}
    for k, module in enumerate(modules):
        for name, p in module.named_parameters(remove_duplicate=False):
            first = owner.setdefault(id(p), (k, name))
            if first[0] != k:
                a, b = mesh.stages[first[0]], mesh.stages[k]
                raise StageError(
                    f"{mesh.prefix} stages {a} and {b}, both on this rank, hold one tensor "
                    f"({first[1]!r} in stage {a}, {name!r} in stage {b}), as the {method} split "
                    "shares a tied weight between the stages that use it.\n  why: torch scales "
                    "and DDP reduces each stage's gradients on its own, so a tensor in two "
                    "stages of one rank would be scaled and reduced twice.\n  fix: split with "
                    "'pipeline' (it copies a tied weight into each stage and the runtime sums "
                    "their gradients), or move a split point so that the stages using it run "
                    "on different pipeline ranks"
                )


def rank_module(stages: Sequence[StageModule]) -> nn.Module:
    """This rank's stages as one module, for an API that takes one (DCP's optimizer state).

    The stage's own module when there is one; with several (v > 1) a module tree
    holding every stage's parameters and buffers under the model's names (the
    same tensors, nothing copied), e.g. ``blocks.0…`` from stage 0 beside
    ``blocks.4…`` from stage 2.

    Raises:
        StageError: two stages of this rank hold different tensors under one name.
    """
    if len(stages) == 1:
        return stages[0].module
    root = nn.Module()
    placed: dict[str, tuple[int, int]] = {}  # name -> (stage, id)
    for st in stages:
        named = [
            *((n, t, True) for n, t in st.module.named_parameters(remove_duplicate=False)),
            *((n, t, False) for n, t in st.module.named_buffers(remove_duplicate=False)),
        ]
        for name, t, is_param in named:
            first = placed.setdefault(name, (st.index, id(t)))
            if first[1] != id(t):
                raise StageError(
                    f"stages {first[0]} and {st.index} of this rank hold different tensors "
                    f"named {name!r}; they cannot be saved as one module's.\n  fix: move a "
                    "split point so that the stages sharing the name run on different ranks"
                )
            *path, leaf = name.split(".")
            holder = root
            for part in path:
                child = holder._modules.get(part)
                if child is None:
                    child = holder._modules[part] = nn.Module()
                holder = child
            table = holder._parameters if is_param else holder._buffers
            table[leaf] = t  # type: ignore[assignment]
    return root


# --------------------------------------------------------------------------- DDP


def replicate(module: nn.Module, mesh: Mesh, plan: Plan) -> nn.Module:
    """The stage over its replicas as the plan's dp mode says: FSDP (``runtime.fsdp``) with
    ``dp_mode: fsdp`` and dp > 1, else DDP (:func:`maybe_ddp`; ZeRO-1's gradients are DDP's)."""
    if plan.dp_mode == "fsdp" and mesh.dp > 1:
        return shard_stage(module, mesh, plan)
    if reduces_by_hand(plan, mesh.dp):  # [Note: DDP under a split backward]
        return module
    return maybe_ddp(module, mesh)


def maybe_ddp(module: nn.Module, mesh: Mesh) -> nn.Module:
    """Wrap in DDP over this stage's replicas, when there are several and something to train.

    [Note: DDP inside a pipeline stage]
    torch's stage runs every micro-batch's forward, and the backward of all but
    the last micro-batch, under ``DistributedDataParallel.no_sync()``; before the
    last backward it calls ``reducer.prepare_for_backward`` itself (stage.py,
    ``backward_maybe_with_nosync``). Gradients therefore accumulate locally over
    the micro-batches and are all-reduced (averaged over dp) once per step,
    during the last backward. No ``find_unused_parameters``: the stage module
    holds only tensors its graph reads (see ``split.used``), so every trainable
    parameter gets a gradient in every backward.
    """
    if mesh.dp == 1:
        return module
    if not any(p.requires_grad for p in module.parameters()):
        log.info("%s stage has no trainable parameters: no DDP", mesh.prefix)
        return module
    device_ids = [mesh.device.index] if mesh.device.type == "cuda" else None
    return _StageDDP(module, device_ids=device_ids, process_group=mesh.dp_group)


class _StageDDP(DistributedDataParallel):
    """DDP that shows the wrapped stage's fx ``graph``, and broadcasts written buffers only.

    torch's traced stage (``_PipelineStage``, the ``pipeline`` path) reads
    ``submod.graph`` to lay out its receive and send buffers on the first step
    (stage.py, ``_create_act_recv_info`` / ``_create_act_send_info``); it is still
    a ``DistributedDataParallel``, so the stage's no_sync handling applies.

    [Note: the buffers DDP broadcasts]
    DDP broadcasts all the module's buffers from rank 0 before every forward: a
    blocking collective over the replicas, once per micro-batch. Buffers the
    forward never writes (position ids, rotary tables, masks) need none: DDP made
    them equal at construction. So the broadcast starts off; the first forward
    in training mode shows whether the stage writes a buffer (BatchNorm's running
    statistics: a written tensor's version counter moves), the replicas agree on it (one
    all-reduce of the flag) and the broadcast is on from then if any does. The
    buffers are DDP's either way: equal before the first forward (the
    construction's sync), rank 0's before every later one. BERT from
    transformers at pp 1 × dp 2, m 1, three alternating launches each: the
    forward took 3.18, 4.98 and 3.83 ms with the broadcast, 2.48, 3.45 and 3.39
    without; the step did not move beyond the launches' spread (10.7–15.9 ms):
    the replicas now wait for each other in the all-reduce instead.
    """

    def __init__(self, module: nn.Module, **kwargs: Any) -> None:
        super().__init__(module, forward_sync_buffers=False, **kwargs)
        self.writes_buffers: bool | None = None if self.modules_buffers else False

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.writes_buffers is not None or not self.module.training:  # decided in training
            return super().forward(*inputs, **kwargs)
        versions = [b._version for b in self.modules_buffers]
        out = super().forward(*inputs, **kwargs)
        moved = any(b._version != v for b, v in zip(self.modules_buffers, versions, strict=True))
        flag = torch.tensor([int(moved)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.process_group)
        self.writes_buffers = bool(flag.item())
        self.forward_sync_buffers = self.writes_buffers
        return out

    @property
    def graph(self) -> torch.fx.Graph:
        graph = self.module.graph
        assert isinstance(graph, torch.fx.Graph)
        return graph
