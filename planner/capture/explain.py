"""Why capturing a model failed: the module and source line that broke tracing, and the fix."""

from __future__ import annotations

import linecache
import re
import traceback

from torch import nn

from planner.plan.text import first_line

__all__ = ["explain_failure"]

# What torch says for an operator given tensors on two devices (eager, fake or meta).
_DEVICES = re.compile(
    r"Expected all tensors to be on the same device|is not on the expected device|"
    r"found at least two devices",
)


def _first_line(exc: BaseException) -> str:
    return first_line(exc) or type(exc).__name__


def explain_failure(model: nn.Module, export_exc: Exception, fx_exc: Exception) -> str:
    """The CaptureError's message: where tracing broke, what each tracer said, why, the fix."""
    where = _culprit(model, fx_exc) or _culprit(model, export_exc)
    if where is not None:
        fqn, type_name, filename, lineno, line = where
        location = (
            f"The failure is in module '{fqn or '<root>'}' ({type_name}), "
            f"{filename}:{lineno}:\n    {line}\n"
        )
    else:
        location = "No module of the model appears in the traceback.\n"
    if type(export_exc) is type(fx_exc) and str(export_exc) == str(fx_exc):
        # Both tracers run the forward on the sample: the same error from both is
        # the model's own, not a tracing problem.
        return (
            "could not capture the model as a graph: running it on the sample batch raised "
            f"{type(fx_exc).__name__}: {_first_line(fx_exc)}\n"
            f"{location}"
            "Why: both tracers run the forward pass on the sample batch, and the model "
            "itself fails on it (calling model(*inputs) directly raises the same).\n"
            "Fix: make the forward run on this input (its shapes, dtypes and batch size)."
        )
    said = str(export_exc)
    if any(_DEVICES.search(str(e)) for e in (export_exc, fx_exc)):
        return _device_mismatch(model, export_exc, location)
    if "in output, which is not a known type" in said and "Cache" in said:
        # transformers returns its key/value cache (a DynamicCache object) by default.
        return (
            "could not capture the model as a graph: its output holds a key/value cache "
            f"object ({_first_line(export_exc)[:160]})\n"
            f"{location}"
            "Why: a cache is for generation; the planner traces training, and a pipeline "
            "stage passes only tensors.\n"
            "Fix: build the model for training with use_cache=False (in its config, e.g. "
            "`LlamaConfig(..., use_cache=False)`, or `model.config.use_cache = False`)."
        )
    return (
        "could not capture the model as a graph.\n"
        f"{location}"
        f"torch.export (non-strict) said: {type(export_exc).__name__}: {_first_line(export_exc)}\n"
        f"torch.fx.symbolic_trace said: {type(fx_exc).__name__}: {_first_line(fx_exc)}\n"
        "Why: the planner needs one graph of the forward pass; Python control flow that "
        "depends on tensor values (e.g. `if x.sum() > 0:`) or untraceable operations stop "
        "both tracers.\n"
        "Fix: make the branch depend on configuration instead of tensor data, express it "
        "with tensor ops (torch.where) or torch.cond, or move the data-dependent part out "
        "of forward (e.g. into the loss or the data pipeline)."
    )


def _device_mismatch(model: nn.Module, exc: Exception, location: str) -> str:
    """Tensors on two devices (a meta model with a CPU batch, say): not a tracing problem."""
    held: dict[str, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        held[str(t.device)] = held.get(str(t.device), 0) + 1
    on = ", ".join(f"{n} on {d}" for d, n in sorted(held.items())) or "none"
    meta = "meta" in held
    return (
        "could not capture the model as a graph: its tensors are on different devices "
        f"({type(exc).__name__}: {_first_line(exc)})\n"
        f"{location}"
        f"The model's parameters and buffers: {on}.\n"
        "Why: every tensor an operator takes must be on one device; the batch the model "
        "file's sample_batch returns is on another device than the parameters"
        + (
            " (meta tensors have shapes but no values: nothing can be measured on them)"
            if meta
            else ""
        )
        + ".\n"
        "Fix: build the model and draw the batch on the same real device (no "
        "`torch.device('meta')` in build_model, or move the batch with `.to(device)`)"
        + (
            "; or plan a meta model analytically for a catalogue device (e.g. --device-type "
            "h100), which needs shapes only"
            if meta
            else ""
        )
        + "."
    )


def _culprit(model: nn.Module, exc: BaseException) -> tuple[str, str, str, int, str] | None:
    """The innermost frame of the traceback running a submodule of ``model``."""
    names = {id(m): name for name, m in model.named_modules()}
    found = None
    chain: list[BaseException] = []
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        chain.append(e)
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    for err in chain:
        for frame, lineno in traceback.walk_tb(err.__traceback__):
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and id(owner) in names:
                code = frame.f_code
                line = _source_line(code.co_filename, lineno)
                found = (names[id(owner)], type(owner).__name__, code.co_filename, lineno, line)
        if found is not None:
            return found
    return None


def _source_line(filename: str, lineno: int) -> str:
    return linecache.getline(filename, lineno).strip()
