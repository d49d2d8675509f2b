"""This rank's pipeline stage: the model split at the plan's split points, DDP over replicas.

Two ways to split, the same result (a submodule per stage whose parameters and
buffers keep the model's FQNs):

* ``pipeline``: ``torch.distributed.pipelining.pipeline(model, split_spec=...)``
  (torch.export underneath), then ``pipe.build_stage``. The primary path.
* ``fx``: the fallback for models torch.export cannot take.
  ``torch.fx.symbolic_trace``, each node given to the stage whose split point
  it follows (by the module it belongs to), every value a later stage needs
  passed along the chain; then a manual ``PipelineStage`` with the example
  shapes measured here, so torch's metadata inference never runs a forward.

Every rank splits the whole model (deterministically), so every rank knows
which stage holds which parameter: tied-weight groups need that. Each rank then
keeps only its own stage; names a stage module carries but never uses (e.g. the
untouched original of a tied weight that ``pipeline`` copies) are removed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from torch import nn
from torch.distributed.pipelining import PipelineStage, pipe_split, pipeline
from torch.nn.parallel import DistributedDataParallel
from torch.utils import _pytree as pytree

from planner.plan import Plan
from runtime.mesh import Mesh

__all__ = ["SPLIT_METHODS", "StageError", "StageModule", "build_stage", "split_model"]

log = logging.getLogger(__name__)

SPLIT_METHODS = ("auto", "pipeline", "fx")
"""``auto``: ``pipeline`` first, ``fx`` when it fails; the others force one path."""

Example = tuple[tuple[Any, ...], dict[str, Any]]


class StageError(ValueError):
    """The model cannot be split as the plan says; the message names the split points."""


@dataclass(eq=False)
class StageModule:
    """This rank's stage, ready for a schedule.

    Attributes:
        index: the stage index; ``num_stages`` the pipeline depth.
        module: the stage's submodule; its parameters and buffers keep the
            model's FQNs (``blocks.3.attn.qkv.weight``).
        wrapped: ``DistributedDataParallel(module)`` when dp > 1 and the stage
            has trainable parameters, else ``module``.
        pipeline_stage: torch's stage object the schedule runs.
        method: how the model was split: "pipeline" or "fx".
        fallback_reason: why ``pipeline`` was not used (None when it was).
        held: for every stage (not only this one), the names of the parameters
            and buffers its module keeps, all aliases included.
    """

    index: int
    num_stages: int
    module: nn.Module
    wrapped: nn.Module
    pipeline_stage: Any
    method: str
    fallback_reason: str | None
    held: tuple[frozenset[str], ...]

    @property
    def ddp(self) -> bool:
        return isinstance(self.wrapped, DistributedDataParallel)

    def trainable(self) -> list[nn.Parameter]:
        """This stage's parameters that require grad, each tensor once."""
        return [p for p in self.module.parameters() if p.requires_grad]


# --------------------------------------------------------------------------- build


def build_stage(
    model: nn.Module, plan: Plan, mesh: Mesh, example: Example, *, split: str = "auto"
) -> StageModule:
    """Split ``model`` as ``plan`` says and build this rank's stage (DDP-wrapped if dp > 1).

    Example::

        stage = build_stage(model, plan, mesh, ((x[:4],), {}))
        schedule = ScheduleGPipe(stage.pipeline_stage, plan.micro_batches, loss_fn=loss)

    Args:
        model: the whole model, the same (same initial values) on every rank.
            Its stage shares tensors with it (no copies on the CPU).
        example: ONE micro-batch's ``(args, kwargs)``, of the plan's micro-batch
            size: ``pipeline`` traces static shapes.
        split: one of :data:`SPLIT_METHODS`.

    Raises:
        StageError: the split does not give ``plan.pp`` stages, or both ways to
            split failed (the message says why each did).
    """
    if split not in SPLIT_METHODS:
        raise ValueError(f"split must be one of {', '.join(SPLIT_METHODS)}, got {split!r}")
    parts = _split(model, plan, example, split)
    used = [_used_tensors(m) for m in parts.modules]
    held = tuple(frozenset(names) for names in used)
    s = mesh.stage
    module = parts.modules[s]
    _prune(module, used[s])
    if parts.pipe is not None:
        stage = parts.pipe.build_stage(s, mesh.device, group=mesh.pp_group)
    else:
        ins, outs = parts.shapes[s]
        stage = PipelineStage(
            module,
            s,
            plan.pp,
            mesh.device,
            input_args=ins,
            output_args=outs,
            group=mesh.pp_group,
        )
    # The pp group's ranks are sorted by global rank; the plan's stage order may differ.
    stage.stage_index_to_group_rank = {
        i: dist.get_group_rank(mesh.pp_group, mesh.grid[mesh.replica][i]) for i in range(plan.pp)
    }
    wrapped = _maybe_ddp(module, mesh)
    stage.submod = wrapped
    log.info(
        "%s stage %d/%d built with %s: %d parameters (%d trainable), %s",
        mesh.prefix,
        s,
        plan.pp,
        parts.method,
        sum(1 for _ in module.parameters()),
        sum(p.numel() for p in module.parameters() if p.requires_grad),
        "DDP" if wrapped is not module else "no DDP",
    )
    return StageModule(
        index=s,
        num_stages=plan.pp,
        module=module,
        wrapped=wrapped,
        pipeline_stage=stage,
        method=parts.method,
        fallback_reason=parts.reason,
        held=held,
    )


@dataclass
class _Parts:
    """The whole model split: every stage's module, and how (dropped once this rank's is built)."""

    modules: list[nn.Module]
    method: str
    reason: str | None = None
    pipe: Any = None  # the Pipe (pipeline path)
    shapes: list[tuple[Any, Any]] = field(default_factory=list)  # fx path


def _split(model: nn.Module, plan: Plan, example: Example, split: str) -> _Parts:
    points = plan.split_points
    reason: str | None = None
    if split in ("auto", "pipeline"):
        try:
            pipe = _split_pipeline(model, points, example)
        except Exception as exc:
            if split == "pipeline":
                raise StageError(
                    f"torch.distributed.pipelining.pipeline() could not split the model at "
                    f"{points}: {type(exc).__name__}: {_first_line(exc)}"
                ) from exc
            reason = f"{type(exc).__name__}: {_first_line(exc)}"
            log.warning("pipeline() failed (%s); splitting a symbolic_trace graph instead", reason)
        else:
            _check_count(pipe.num_stages, plan)
            mods = [pipe.get_stage_module(i) for i in range(pipe.num_stages)]
            return _Parts(modules=mods, method="pipeline", pipe=pipe)
    try:
        mods, shapes = split_model(model, points, example)
    except StageError as exc:
        if reason is None:
            raise
        raise StageError(f"{exc}\n  (pipeline() failed first: {reason})") from exc
    return _Parts(modules=list(mods), method="fx", reason=reason, shapes=shapes)


def _check_count(n: int, plan: Plan) -> None:
    if n != plan.pp:
        raise StageError(
            f"splitting at the plan's split points {plan.split_points} gave {n} stages, but "
            f"the plan has pp = {plan.pp}.\n  why: a split point module is not called in the "
            "forward, or is called where torch.export cannot cut (inside another call).\n"
            "  fix: re-plan the model (`planner plan`), or edit the plan's split points to "
            "module calls on the forward's main path"
        )


def _first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, and of its cause's (pipeline() wraps export's)."""
    text = str(exc).strip().splitlines()
    line = text[0][:300] if text else ""
    cause = exc.__cause__
    if cause is not None:
        inner = str(cause).strip().splitlines()
        line += f" (caused by {type(cause).__name__}: {inner[0][:300] if inner else ''})"
    return line


# --------------------------------------------------------------------------- pipeline()


def _split_pipeline(model: nn.Module, points: list[str], example: Example) -> Any:
    """``pipeline()`` with a ``pipe_split()`` before the FIRST call of each split point module.

    ``split_spec={fqn: SplitPoint.BEGINNING}`` would split before *every* call
    of the module (a ReLU applied twice in a residual block gives two splits),
    but a plan's split point is the start of the module's first call (the
    planner never proposes a later call). So the markers are forward pre-hooks
    that fire once per trace; they are removed afterwards, leaving the model as
    it was.
    """
    args, kwargs = example
    armed = dict.fromkeys(points, True)

    def marker(fqn: str) -> Any:
        def hook(module: nn.Module, inputs: Any) -> None:
            if armed[fqn]:
                armed[fqn] = False
                pipe_split()

        return hook

    handles = []
    modes = [(m, m.training) for m in model.modules()]
    try:
        for fqn in points:
            try:
                mod = model.get_submodule(fqn)
            except AttributeError as exc:
                raise StageError(f"split point {fqn!r} is not a submodule of the model") from exc
            handles.append(mod.register_forward_pre_hook(marker(fqn)))
        return pipeline(model, mb_args=tuple(args), mb_kwargs=dict(kwargs) or None)
    finally:
        for handle in handles:
            handle.remove()
        for m, training in modes:
            m.training = training


# --------------------------------------------------------------------------- fx fallback


def split_model(
    model: nn.Module, points: list[str], example: Example
) -> tuple[list[torch.fx.GraphModule], list[tuple[Any, Any]]]:
    """Split ``model`` at ``points`` with ``torch.fx.symbolic_trace`` (the fallback path).

    Example::

        mods, shapes = split_model(model, ["layers.4"], ((x,), {}))
        out = mods[1](*mods[0](x))          # == model(x)

    Stage 0 takes the model's own arguments. Every later stage takes, and every
    stage but the last returns, a tuple of the tensors still needed further on
    (skip connections are passed along the chain). The last stage returns the
    model's output.

    Returns:
        The stage modules (sharing the model's submodules and tensors), and for
        each stage its example ``(inputs, outputs)`` tensors (of ``example``'s
        batch size) for ``PipelineStage(input_args=..., output_args=...)``.

    Raises:
        StageError: tracing failed, a split point is never reached or leaves a
            stage empty, or a non-tensor value would cross a split point.
    """
    try:
        traced = torch.fx.symbolic_trace(model)
    except Exception as exc:
        raise StageError(
            f"torch.fx.symbolic_trace could not trace the model either: {type(exc).__name__}: "
            f"{_first_line(exc)}\n  fix: remove data-dependent Python control flow from "
            "forward(), or make the model exportable with torch.export"
        ) from exc
    nodes = list(traced.graph.nodes)
    n_stages = len(points) + 1
    stage_of = _assign(nodes, points)
    users: dict[torch.fx.Node, int] = {}  # node -> last stage that reads it
    for node in nodes:
        if node not in stage_of:
            continue
        last = -1
        for user in node.users:
            last = max(last, n_stages - 1 if user.op == "output" else stage_of[user])
        users[node] = last
    order = {n: k for k, n in enumerate(nodes)}
    live_in: list[list[torch.fx.Node]] = [[]] + [
        sorted((n for n in stage_of if stage_of[n] < s and users[n] >= s), key=order.__getitem__)
        for s in range(1, n_stages)
    ]
    output = next(n for n in nodes if n.op == "output")
    mods = [
        _stage_graph(traced, nodes, stage_of, live_in, output, s, n_stages) for s in range(n_stages)
    ]
    return mods, _example_shapes(model, mods, live_in, example)


def _module_path(node: torch.fx.Node) -> str:
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    last = list(stack.values())[-1]
    return str(last[0] if isinstance(last, tuple) else last)


def _assign(nodes: list[torch.fx.Node], points: list[str]) -> dict[torch.fx.Node, int]:
    """Each compute node's stage: the number of split points whose module has begun."""
    stage_of: dict[torch.fx.Node, int] = {}
    cur = 0
    first: dict[int, torch.fx.Node] = {}
    for node in nodes:
        if node.op == "placeholder":
            stage_of[node] = 0
            continue
        if node.op in ("get_attr", "output"):
            continue  # parameters are re-read in every stage that uses them
        path = _module_path(node)
        for j in range(len(points) - 1, cur - 1, -1):
            if path == points[j] or path.startswith(points[j] + "."):
                cur = j + 1
                break
        stage_of[node] = cur
        first.setdefault(cur, node)
    empty = [s for s in range(1, len(points) + 1) if s not in first]
    if empty or cur != len(points):
        names = [points[s - 1] for s in empty] or points[cur:]
        raise StageError(
            f"split point(s) {names} start no stage of the traced graph (split points "
            f"{points}): the module is never called, or called out of order.\n"
            "  fix: re-plan the model, or edit the plan's split points to module calls on the "
            "forward's main path, in execution order"
        )
    return stage_of


def _stage_graph(
    traced: torch.fx.GraphModule,
    nodes: list[torch.fx.Node],
    stage_of: dict[torch.fx.Node, int],
    live_in: list[list[torch.fx.Node]],
    output: torch.fx.Node,
    s: int,
    n_stages: int,
) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}

    def lookup(n: torch.fx.Node) -> torch.fx.Node:
        if n not in env:
            assert n.op == "get_attr", f"{n} is needed by stage {s} but not passed to it"
            env[n] = graph.node_copy(n)
        return env[n]

    for n in live_in[s] if s > 0 else []:
        env[n] = graph.placeholder(n.name)
    for n in nodes:
        if stage_of.get(n) == s:
            env[n] = graph.node_copy(n, lookup)
    if s < n_stages - 1:
        graph.output(tuple(lookup(n) for n in live_in[s + 1]))
    else:
        graph.output(torch.fx.node.map_arg(output.args[0], lookup))
    gm = torch.fx.GraphModule(traced, graph, class_name=f"Stage{s}")
    gm.graph.lint()
    return gm


def _example_shapes(
    model: nn.Module,
    mods: list[torch.fx.GraphModule],
    live_in: list[list[torch.fx.Node]],
    example: Example,
) -> list[tuple[Any, Any]]:
    """Run the chain once on ``example`` (no grad, RNG and buffers restored) for the shapes."""
    args, kwargs = example
    shapes: list[tuple[Any, Any]] = []
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        try:
            inputs: tuple[Any, ...] = tuple(args)
            out: Any = mods[0](*args, **kwargs)
            for s in range(len(mods)):
                if s > 0:
                    inputs = tuple(out)
                    out = mods[s](*inputs)
                if s < len(mods) - 1:
                    _check_tensors(out, live_in[s + 1], s)
                    outs = tuple(_meta_like(t) for t in out)
                else:
                    outs = tuple(t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
                ins = tuple(
                    t if s == 0 else _meta_like(t) for t in inputs if isinstance(t, torch.Tensor)
                )
                shapes.append((ins, outs))
        finally:
            for b, v in saved:
                b.copy_(v)
    return shapes


def _check_tensors(out: tuple[Any, ...], names: list[torch.fx.Node], s: int) -> None:
    bad = [
        f"{n.name} ({type(v).__name__})"
        for n, v in zip(names, out, strict=True)
        if not isinstance(v, torch.Tensor)
    ]
    if bad:
        raise StageError(
            f"non-tensor value(s) {bad} cross the split between stages {s} and {s + 1}; "
            "pipeline stages exchange tensors only.\n  fix: move the split point, or compute "
            "the value inside the stage that uses it"
        )


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    """A detached copy whose ``requires_grad`` says whether a gradient flows back through it."""
    return t.detach().clone().requires_grad_(t.is_floating_point())


# --------------------------------------------------------------------------- used state


def _used_tensors(root: nn.Module) -> set[str]:
    """Names (all aliases) of the parameters and buffers ``root``'s graphs actually read.

    A tensor is used when a ``get_attr`` of a graph reaches it, or when it
    belongs to a module the graph calls that has no graph of its own (a leaf).
    """
    read: set[int] = set()
    seen: set[int] = set()

    def mark(mod: nn.Module) -> None:
        read.update(id(t) for _, t in _state(mod))

    def visit(mod: nn.Module) -> None:
        if id(mod) in seen:
            return
        seen.add(id(mod))
        calls = getattr(mod, "call_modules", None)  # export's dispatcher of repeated calls
        graph = getattr(mod, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            if callable(calls):
                for call in calls():
                    visit(call)
            else:
                mark(mod)
            return
        for node in graph.nodes:
            if node.op == "get_attr":
                target = _resolve(mod, str(node.target))
                if isinstance(target, nn.Module):
                    mark(target)
                elif isinstance(target, torch.Tensor):
                    read.add(id(target))
            elif node.op == "call_module":
                visit(mod.get_submodule(str(node.target)))

    visit(root)
    return {name for name, t in _state(root) if id(t) in read}


def _state(mod: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    yield from mod.named_parameters(remove_duplicate=False)
    yield from mod.named_buffers(remove_duplicate=False)


def _resolve(mod: nn.Module, target: str) -> Any:
    obj: Any = mod
    for atom in target.split("."):
        obj = getattr(obj, atom, None)
        if obj is None:
            return None
    return obj


def _prune(module: nn.Module, used: set[str]) -> None:
    """Remove the parameters and buffers ``module`` holds but never reads."""
    for name, _ in list(_state(module)):
        if name in used:
            continue
        owner, _, leaf = name.rpartition(".")
        parent = module.get_submodule(owner) if owner else module
        if leaf in parent._parameters:
            del parent._parameters[leaf]
        elif leaf in parent._buffers:
            del parent._buffers[leaf]
            parent._non_persistent_buffers_set.discard(leaf)


# --------------------------------------------------------------------------- DDP


def _maybe_ddp(module: nn.Module, mesh: Mesh) -> nn.Module:
    """Wrap in DDP over this stage's replicas, when there are several and something to train.

    [Note: DDP inside a pipeline stage]
    torch's stage runs every micro-batch's forward, and the backward of all but
    the last micro-batch, under ``DistributedDataParallel.no_sync()``; before the
    last backward it calls ``reducer.prepare_for_backward`` itself (stage.py,
    ``backward_maybe_with_nosync``). Gradients therefore accumulate locally over
    the micro-batches and are all-reduced (averaged over dp) once per step,
    during the last backward. No ``find_unused_parameters``: the stage module
    holds only tensors its graph reads (see ``_prune``), so every trainable
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
    """DDP that shows the wrapped stage's fx ``graph``.

    torch's traced stage (``_PipelineStage``, the ``pipeline`` path) reads
    ``submod.graph`` to lay out its receive and send buffers on the first step
    (stage.py, ``_create_act_recv_info`` / ``_create_act_send_info``); it is still
    a ``DistributedDataParallel``, so the stage's no_sync handling applies.
    """

    @property
    def graph(self) -> torch.fx.Graph:
        graph = self.module.graph
        assert isinstance(graph, torch.fx.Graph)
        return graph
