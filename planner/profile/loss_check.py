"""A loss that fails on an output whose batch size depends on the data, explained.

A forward that returns ``out[out.sum(-1) > 0]`` or ``x[torch.nonzero(m)...]``
gives an output with as many rows as the data selects, not one per sample; the
default loss (or a ``loss_fn`` that pairs rows with targets) then fails with a
message about shapes alone. :func:`checked_loss` wraps the loss so that such a
failure names the operation, module and source line that made the size depend
on the values (:func:`planner.capture.dynamic.data_dependent_outputs`), and the
fix. Only a failure is explained, and only when the loss read such an output
(it is run once more under a ``TorchFunctionMode`` that records what it reads):
a loss that copes with the varying size runs as it is, and one that fails on
something else keeps its own error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_leaves

from planner.capture.dynamic import data_dependent_outputs
from planner.capture.trace import Captured
from planner.plan.batch import batch_size_of
from planner.plan.text import first_line

__all__ = ["checked_loss"]

Loss = Callable[[Any, Any], torch.Tensor]


def checked_loss(loss_fn: Loss | None, cap: Captured) -> Loss | None:
    """``loss_fn``, with its failures on a data-dependent batch size explained.

    Example::

        loss_fn = checked_loss(loss_fn, cap)
        loss = loss_fn(model(*cap.sample_args), targets)

    Raises (from the returned loss):
        ValueError: the loss raised, and it read one of the model's outputs (the
            graph's ``cap``) whose dim 0 differs from the batch and is set by a
            data-dependent operation (the loss is run once more to see what it
            reads); the original error is its ``__cause__``. Any other failure is
            raised as it was.
    """
    if loss_fn is None:
        return None
    inner = loss_fn

    def loss(outputs: Any, targets: Any) -> torch.Tensor:
        try:
            return inner(outputs, targets)
        except Exception as exc:
            explained = _explain(exc, inner, outputs, targets, cap)
            if explained is None:
                raise
            raise explained from exc

    return loss


def _explain(
    exc: Exception, loss: Loss, outputs: Any, targets: Any, cap: Captured
) -> ValueError | None:
    """The error for ``exc`` when the loss read an output whose dim 0 is data-dependent and
    not the batch (a ``ValueError``), else None."""
    try:
        batch = batch_size_of(cap.sample_args, cap.sample_kwargs)
    except ValueError:
        return None  # no batch dimension to compare with
    leaves = tree_flatten_with_path(outputs)[0]
    origins = data_dependent_outputs(cap)
    if len(leaves) != len(origins):
        return None  # the graph's outputs and these do not line up: say nothing wrong
    suspects = {
        id(leaf): (keystr(path), found)
        for (path, leaf), found in zip(leaves, origins, strict=True)
        if found and isinstance(leaf, torch.Tensor) and leaf.dim() and leaf.shape[0] != batch
    }
    read = _read(loss, outputs, targets, set(suspects)) if suspects else []
    if not read:  # the loss failed on something else: its own error says what
        return None
    leaf = read[0]
    path, found = suspects[id(leaf)]
    name = "the model's output" + (path if len(leaves) > 1 else "")
    return _error(name, int(leaf.shape[0]), batch, [str(o) for o in found], exc)


class _Reads(TorchFunctionMode):
    """Records which of the tensors ``watched`` (by ``id``) a torch function was given."""

    def __init__(self, watched: set[int]) -> None:
        super().__init__()
        self.watched = watched
        self.read: list[torch.Tensor] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for a in tree_leaves((args, kwargs or {})):
            if isinstance(a, torch.Tensor) and id(a) in self.watched:
                self.watched.discard(id(a))
                self.read.append(a)
        return func(*args, **(kwargs or {}))


def _read(loss: Loss, outputs: Any, targets: Any, watched: set[int]) -> list[torch.Tensor]:
    """The tensors of ``watched`` that the loss reads before it fails: it is run once more,
    its shapes, sizes and operations recorded (a failure again is expected)."""
    mode = _Reads(watched)
    try:
        with torch.no_grad(), mode:
            loss(outputs, targets)
    except Exception:  # the failure being explained, again
        pass
    return mode.read


def _error(name: str, size: int, batch: int, origins: list[str], exc: Exception) -> ValueError:
    by = "\n".join(f"      {o}" for o in origins)
    return ValueError(
        f"{name} has a batch dimension (dim 0) of {size} where the batch is {batch}: its size "
        f"depends on the tensor values, and the loss failed on it ({type(exc).__name__}: "
        f"{first_line(exc)})\n"
        f"  why: that dim 0 is set by\n{by}\n"
        "    whose size depends on the values, not on the batch size; the loss reads the "
        f"output batch first against the {batch} targets (and the planner cuts both into "
        "micro-batches along dim 0), so this batch and others fail or pair the wrong rows\n"
        "  fix: keep the data-dependent shape inside a module and return a tensor of fixed "
        "size, batch first: multiply by the mask instead of selecting with it (e.g. "
        "`out * mask.unsqueeze(-1)`), or pad the selected rows to the batch size; or define "
        "loss_fn(outputs, targets) in the model file to take an output of varying size (e.g. "
        "return the mask too and select the same rows of the targets)"
    )
