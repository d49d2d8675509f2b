"""The primary split: ``torch.distributed.pipelining.pipeline()`` at the plan's split points."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch.fx
from torch import nn
from torch.distributed.pipelining import Pipe, pipe_split, pipeline
from torch.export import ExportedProgram
from torch.export.unflatten import InterpreterModule
from torch.utils import _pytree as pytree

from runtime.split.errors import Example, StageError
from runtime.split.relay import relay

__all__ = ["compiled", "output_restorer", "split_pipeline"]


def split_pipeline(
    model: nn.Module, points: list[str], example: Example
) -> tuple[Any, Callable[[Any], Any]]:
    """``pipeline()`` with a ``pipe_split()`` before the FIRST call of each split point module.

    ``split_spec={fqn: SplitPoint.BEGINNING}`` would split before *every* call
    of the module (a ReLU applied twice in a residual block gives two splits),
    but a plan's split point is the start of the module's first call (the
    planner never proposes a later call). So the markers are forward pre-hooks
    that fire once per trace; they are removed afterwards, leaving the model as
    it was.

    Returns:
        torch's Pipe, relayed (``runtime.split.relay``), and the function that
        turns the last stage's flat outputs back into what the model returns
        (``output_restorer``).
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
        with _recorded_export() as exported:
            pipe = pipeline(model, mb_args=tuple(args), mb_kwargs=dict(kwargs) or None)
    finally:
        for handle in handles:
            handle.remove()
        for m, training in modes:
            m.training = training
    relay(pipe)
    compiled(pipe.split_gm)
    return pipe, output_restorer(pipe, exported[0].call_spec.out_spec)


def compiled(module: nn.Module) -> int:
    """Make export's stage modules run their graphs' generated code; returns how many.

    [Note: the stages run generated code] ``pipeline()`` builds each stage from
    ``torch.export``'s unflattened modules (``InterpreterModule``), which by
    default execute their graph through ``torch.fx.Interpreter``, one Python
    call per node: on small, op-heavy stages that doubles the step (a 2-stage
    Llama from transformers, forward and backward: 10.9 ms interpreted, 5.6 ms
    generated code), while the profile timed the same blocks as generated code.
    Each module then runs the code its graph generates, called on the module
    itself (what torch does under dynamo: the same graph, the same attributes).
    Two things first: the code is generated again from the graph as it is now
    (``relay`` edits the graphs after export generated it), and a node named
    ``self`` (a call of a submodule named so, BERT's ``attention.self``) is
    renamed: as a local variable it would hide the module in the code.
    """
    count = 0
    for m in module.modules():
        if not isinstance(m, InterpreterModule) or not getattr(m, "_run_with_interpreter", 0):
            continue
        gm = m.__dict__.get("graph_module")  # set by finalize(), outside the submodules
        if gm is None:
            continue
        for node in m.graph.nodes:
            if node.name == "self":
                node._rename("self_")
        gm.recompile()
        m._run_with_interpreter = False
        count += 1
    return count


@contextlib.contextmanager
def _recorded_export() -> Iterator[list[ExportedProgram]]:
    """The ExportedProgram that ``pipeline()`` traces (the Pipe keeps no output tree spec)."""
    seen: list[ExportedProgram] = []
    original = Pipe.__dict__["_trace_with_export"]

    def recording(*args: Any, **kwargs: Any) -> ExportedProgram:
        ep = original.__func__(*args, **kwargs)
        seen.append(ep)
        return ep

    Pipe._trace_with_export = staticmethod(recording)  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        Pipe._trace_with_export = original  # type: ignore[method-assign]


def output_restorer(pipe: Any, spec: pytree.TreeSpec | None) -> Callable[[Any], Any]:
    """``restore(last_stage_output)``: what the model returns (a ModelOutput, a dict, a tuple...).

    The last stage returns the model's outputs flattened (a tensor, or a tuple of
    them); ``spec`` is the tree they came from. The loss sees the model's own
    output in profiling, planning and training alike.
    """
    graph = pipe.split_gm.graph
    output = graph.output_node()
    leaves: list[torch.fx.Node] = []
    torch.fx.node.map_arg(output.args, leaves.append)
    picks = [None if x.op == "call_module" else x.args[1] for x in leaves]
    if spec is None or spec.num_leaves != len(picks):
        return lambda out: out

    def restore(out: Any) -> Any:
        flat = [out if j is None else out[j] for j in picks]
        return pytree.tree_unflatten(flat, spec)

    return restore
