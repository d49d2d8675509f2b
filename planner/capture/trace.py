"""Capture a model as a torch.fx graph whose nodes know the module call they belong to.

``torch.export`` (non-strict) first: it runs the model's Python code for real, so
control flow on configuration values, keyword arguments, dict/tuple outputs,
buffers and tied parameters all work. ``torch.fx.symbolic_trace`` is the
fallback for the rare model export rejects. When both fail, ``CaptureError``
names the module and source line that broke tracing and suggests the fix.

The captured ``GraphModule`` shares its parameters and buffers with the model
(no copies): running it updates e.g. BatchNorm statistics of the model itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from planner.capture.explain import explain_failure
from planner.plan.text import first_line

__all__ = ["CaptureError", "Captured", "ModuleCall", "TensorInfo", "ValueInfo", "capture"]

log = logging.getLogger(__name__)


class CaptureError(ValueError):
    """Neither torch.export nor symbolic_trace could capture the model."""


@dataclass(frozen=True)
class ModuleCall:
    """One entry of a node's module stack: a call of a submodule.

    ``key`` identifies the call (a module called twice has two keys); ``fqn`` is
    the module's qualified name; ``type_name`` its class, e.g. "torch.nn.Linear".
    """

    key: str
    fqn: str
    type_name: str


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of a tensor value in the graph (no data).

    ``data_dependent``: a dimension depends on tensor values (``nonzero``,
    boolean masking): ``shape`` is the traced sample's, other batches differ.
    ``contiguous``: its strides are those of a dense row-major tensor (a stage
    sending a strided view copies it first).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    data_dependent: bool = False
    contiguous: bool = True

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= int(d)
        return numel * self.dtype.itemsize


# What a node produces: a tensor, or a non-tensor (None, tuple, list, int ...).
ValueInfo = TensorInfo | str


@dataclass
class Captured:
    """A captured model.

    Attributes:
        gm: the runnable graph; parameters are ``get_attr`` nodes that refer to
            the model's own tensors.
        method: "export" or "symbolic_trace".
        stacks: for each call node, the module calls it sits in, outermost
            first (the root module excluded).
        values: for each node, what it produces (``TensorInfo`` or a short
            description of a non-tensor value).
        input_names: the placeholder nodes' names, in order.
        flat_inputs: the sample's values for those placeholders, in order.
        sample_args, sample_kwargs: the sample batch as the model's forward takes it.
        export_error: why torch.export failed, when the fallback was used.
    """

    gm: torch.fx.GraphModule
    method: str
    stacks: dict[torch.fx.Node, tuple[ModuleCall, ...]]
    values: dict[torch.fx.Node, ValueInfo]
    input_names: list[str] = field(default_factory=list)
    flat_inputs: list[Any] = field(default_factory=list)
    sample_args: tuple[Any, ...] = ()
    sample_kwargs: dict[str, Any] = field(default_factory=dict)
    export_error: str | None = None

    def call_nodes(self) -> Iterator[torch.fx.Node]:
        """The nodes that compute something, in execution order."""
        for node in self.gm.graph.nodes:
            if node.op in ("call_function", "call_method", "call_module"):
                yield node


def capture(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
) -> Captured:
    """Capture ``model`` called on one sample batch.

    Example::

        cap = capture(model, (tokens,))
        print(cap.method, len(list(cap.call_nodes())))

    Args:
        model: the model; it is not modified, and its mode (train/eval) is kept.
        args, kwargs: one sample batch, as the model's forward takes it.

    Returns:
        The ``Captured`` graph.

    Raises:
        CaptureError: both capture methods failed; the message names the module
            and source line that broke tracing and how to fix it.
    """
    kwargs = dict(kwargs or {})
    try:
        cap = _capture_export(model, args, kwargs)
    except Exception as export_exc:
        log.info("torch.export failed (%s); trying torch.fx.symbolic_trace", export_exc)
        try:
            cap = _capture_symbolic(model, args, kwargs)
        except Exception as fx_exc:
            raise CaptureError(explain_failure(model, export_exc, fx_exc)) from export_exc
        said = first_line(export_exc) or type(export_exc).__name__
        cap.export_error = f"{type(export_exc).__name__}: {said}"
    cap.sample_args = tuple(args)
    cap.sample_kwargs = kwargs
    return cap


# --------------------------------------------------------------------------- export


def _capture_export(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Captured:
    ep = _export(model, args, kwargs, stack_traces=False)
    if any(_unbacked(node) for node in ep.graph.nodes):  # their messages name source lines
        ep = _export(model, args, kwargs, stack_traces=True)
    gm = ep.module()
    _drop_guard_nodes(gm)
    stacks: dict[torch.fx.Node, tuple[ModuleCall, ...]] = {}
    values: dict[torch.fx.Node, ValueInfo] = {}
    dynamic: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        stacks[node] = _normalize_stack(node.meta.get("nn_module_stack"))
        if _unbacked(node):
            dynamic.add(node)
        else:
            values[node] = _value_info(node.meta.get("val"))
    inputs = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    flat = list(torch.utils._pytree.tree_leaves((args, kwargs)))
    if len(flat) != len(inputs):
        raise RuntimeError(f"export produced {len(inputs)} inputs for {len(flat)} sample values")
    if dynamic:  # sizes known only from the data (nonzero...): the sample's, marked as such
        ran = _propagate(gm, flat)
        for node in dynamic:
            info = ran[node]
            assert isinstance(info, TensorInfo)
            values[node] = dataclasses.replace(info, data_dependent=True)
    return Captured(
        gm=gm,
        method="export",
        stacks=stacks,
        values=values,
        input_names=inputs,
        flat_inputs=flat,
    )


def _export(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, stack_traces: bool
) -> torch.export.ExportedProgram:
    """``torch.export.export`` (non-strict), the model's train/eval modes kept.

    ``stack_traces=False``: the nodes carry no ``stack_trace``. Recording them took
    a quarter of the export: 10.2 against 7.4–8.3 s for Llama 70B's 80 layers on the
    meta device (3 850 nodes). Only the messages about sizes set by the data
    (:mod:`planner.capture.dynamic`) read them: such a graph is exported again with them.
    """
    modes = [(m, m.training) for m in model.modules()]
    fx_config = torch.fx.config
    before = fx_config.do_not_emit_stack_traces
    fx_config.do_not_emit_stack_traces = not stack_traces
    try:
        with _quiet_export():
            return torch.export.export(model, args, kwargs, strict=False)
    finally:
        fx_config.do_not_emit_stack_traces = before
        # Restore every submodule's own mode (a BatchNorm in eval inside a
        # training model stays in eval): model.train(x) would reset them all.
        for m, mode in modes:
            m.training = mode


def _unbacked(node: torch.fx.Node) -> bool:
    """Does ``node``'s value have a size set by the data (an unbacked symbol)?"""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and bool(free_unbacked_symbols(val.shape))


@contextlib.contextmanager
def _quiet_export() -> Iterator[None]:
    """Keep torch.export's failure chatter off the user's terminal.

    On a failure torch.export prints the partial graph to stderr and its shape
    code logs warnings; our CaptureError says what matters, so both go to this
    module's debug log. Whatever else the model writes to stderr is passed on.
    """
    buffer = io.StringIO()
    noisy = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = noisy.level
    noisy.setLevel(logging.ERROR)
    failed = False
    try:
        with contextlib.redirect_stderr(buffer):
            yield
    except BaseException:
        failed = True
        raise
    finally:
        noisy.setLevel(level)
        text = buffer.getvalue()
        if failed and text:
            log.debug("torch.export wrote, before failing:\n%s", text)
        elif text:
            sys.stderr.write(text)


def _drop_guard_nodes(gm: torch.fx.GraphModule) -> None:
    """Remove export's input-guard call (it checks shapes; blocks must not carry it)."""
    changed = False
    for node in list(gm.graph.nodes):
        if (
            node.op == "call_module"
            and str(node.target).startswith("_guards_fn")
            and not node.users
        ):
            gm.graph.erase_node(node)
            changed = True
    if changed:
        gm.recompile()


# --------------------------------------------------------------------------- fx fallback


def _capture_symbolic(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Captured:
    gm = torch.fx.symbolic_trace(model)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    flat = _bind_placeholders(placeholders, args, kwargs)
    values = _propagate(gm, flat)
    stacks: dict[torch.fx.Node, tuple[ModuleCall, ...]] = {}
    for node in gm.graph.nodes:
        stack = _normalize_stack(node.meta.get("nn_module_stack"))
        if node.op == "call_module":
            # symbolic_trace lists a leaf module's own call on its node already;
            # make sure it is there so the node belongs to that call.
            fqn = str(node.target)
            if not stack or stack[-1].fqn != fqn:
                leaf = gm.get_submodule(fqn)
                stack = (*stack, ModuleCall(fqn, fqn, _type_name(type(leaf))))
        stacks[node] = stack
    return Captured(
        gm=gm,
        method="symbolic_trace",
        stacks=stacks,
        values=values,
        input_names=[n.name for n in placeholders],
        flat_inputs=flat,
    )


def _bind_placeholders(
    placeholders: list[torch.fx.Node], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[Any]:
    out: list[Any] = []
    for i, ph in enumerate(placeholders):
        if i < len(args):
            out.append(args[i])
        elif ph.target in kwargs:
            out.append(kwargs[ph.target])
        elif ph.args:
            out.append(ph.args[0])  # the forward's default value
        else:
            raise TypeError(f"no value for the model input {ph.target!r}")
    return out


def _propagate(gm: torch.fx.GraphModule, flat_inputs: list[Any]) -> dict[torch.fx.Node, ValueInfo]:
    """Run the graph once on the sample and record what each node produces."""
    values: dict[torch.fx.Node, ValueInfo] = {}

    class _Recorder(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            result = super().run_node(n)
            values[n] = _value_info(result)
            return result

    state = _snapshot_buffers(gm)
    try:
        with torch.no_grad():
            _Recorder(gm).run(*flat_inputs)
    finally:
        _restore_buffers(gm, state)
    return values


def _snapshot_buffers(module: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(b, b.detach().clone()) for b in module.buffers()]


def _restore_buffers(module: nn.Module, state: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for buf, saved in state:
            buf.copy_(saved)


# --------------------------------------------------------------------------- helpers


def _normalize_stack(raw: Any) -> tuple[ModuleCall, ...]:
    if not raw:
        return ()
    calls = []
    for key, value in raw.items():
        fqn, type_ = value
        if fqn == "":
            continue  # the root module
        type_name = type_ if isinstance(type_, str) else _type_name(type_)
        calls.append(ModuleCall(str(key), str(fqn), type_name))
    return tuple(calls)


def _type_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _value_info(val: Any) -> ValueInfo:
    if isinstance(val, torch.Tensor):
        # Never of a data-dependent shape here: export's such nodes are read from a run.
        return TensorInfo(
            tuple(int(d) for d in val.shape), val.dtype, contiguous=bool(val.is_contiguous())
        )
    if val is None:
        return "None"
    return type(val).__name__
