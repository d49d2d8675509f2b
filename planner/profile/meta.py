"""Shapes only: meta twins of a model and a batch, made without allocating a byte of data.

An analytic profile prices a catalogue device from shapes alone, so it runs the
model on the meta device: a 70 B-parameter model or a batch of ten million
samples costs no memory here. :func:`meta_twin` copies a model with every
parameter and buffer replaced by a meta tensor of the same shape, dtype and
``requires_grad`` (tied parameters stay tied; the model itself is left as it
is); :func:`to_meta` does the same for a batch.

A forward that reads tensor *values* (``.item()``, ``nonzero``, boolean masks)
cannot run on meta: :func:`needs_values` tells such a failure apart from an
ordinary one, and :class:`ShapesOnlyError` says what to do when there are no
real tensors to fall back to.
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from planner.plan.text import first_line

__all__ = [
    "ShapesOnlyError",
    "has_real",
    "meta_twin",
    "needs_values",
    "sampled_on_meta",
    "shapes_only_error",
    "to_meta",
]

log = logging.getLogger(__name__)

T = TypeVar("T")


class ShapesOnlyError(ValueError):
    """The model cannot be profiled on shapes alone, and no real tensors were given."""


def has_real(model: nn.Module | None, *batch: Any) -> bool:
    """Whether ``model`` or ``batch`` holds any tensor that is not on the meta device.

    Example::

        >>> has_real(nn.Linear(2, 2, device="meta"), (torch.zeros(1),))
        True
    """
    tensors: list[Any] = tree_leaves(batch)
    if model is not None:
        tensors += [*model.parameters(), *model.buffers()]
    return any(isinstance(t, torch.Tensor) and not t.is_meta for t in tensors)


def _twin(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a meta tensor (``.to("meta")`` copies no data)."""
    meta = t.detach().to("meta")
    if isinstance(t, nn.Parameter):
        return nn.Parameter(meta, requires_grad=t.requires_grad)
    return meta.requires_grad_() if t.requires_grad else meta


def meta_twin(model: nn.Module) -> nn.Module:
    """A copy of ``model`` on the meta device, made without allocating its tensors.

    ``copy.deepcopy`` with its memo pre-filled: every parameter, buffer and
    plain tensor attribute of a module maps to a meta twin, so the copy shares
    no storage with ``model`` and copies no data. A parameter two modules share
    (tied weights) has one twin, so the copy's are tied too. Everything else
    (configuration, hooks, modes) is copied as ``deepcopy`` would. A model
    already on meta is returned as it is.

    Example::

        >>> big = nn.Linear(4096, 4096)
        >>> twin = meta_twin(big)
        >>> twin.weight.is_meta, big.weight.is_meta, twin.weight.shape == big.weight.shape
        (True, False, True)

    Raises:
        Whatever ``copy.deepcopy`` raises for a model it cannot copy (one that
        holds a lock or an open file, say).
    """
    if not has_real(model):
        return model
    memo: dict[int, Any] = {}
    for module in model.modules():
        held = [*module._parameters.values(), *module._buffers.values()]
        held += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
        for t in held:
            if isinstance(t, torch.Tensor) and id(t) not in memo:
                memo[id(t)] = _twin(t)
    return copy.deepcopy(model, memo)


def to_meta(batch: Any) -> Any:
    """``batch`` (any nesting of tuples, lists and dicts) with every tensor made meta.

    Example::

        >>> to_meta((torch.zeros(2, 3), {"n": 4}))[0].is_meta
        True
    """
    return tree_map(lambda t: _twin(t) if isinstance(t, torch.Tensor) else t, batch)


# Messages torch gives when an operator needs values a meta tensor does not have.
_NEEDS_VALUES = re.compile(
    r"meta tensor|'Meta' backend|meta backend|register_meta|on meta\b|device='?meta",
    re.IGNORECASE,
)


def needs_values(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) says a meta tensor lacked data.

    Example::

        >>> needs_values(RuntimeError("Tensor.item() cannot be called on meta tensors"))
        True
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if _NEEDS_VALUES.search(str(current)):
            return True
        current = current.__cause__ or current.__context__
    return False


def shapes_only_error(exc: BaseException, what: str) -> ShapesOnlyError:
    """The error for a forward that needs tensor values when only meta tensors were given."""
    return ShapesOnlyError(
        f"the analytic profile of {what} failed on the meta device: "
        f"{type(exc).__name__}: {first_line(exc)}\n"
        "  why: a profile for a catalogue device runs the model on shapes alone (meta "
        "tensors hold no data, so no memory is spent); this forward reads tensor values "
        "(.item(), nonzero, boolean masks or the like), which meta tensors do not have.\n"
        "  fix: give the model and the batch with real tensors (the planner then falls back "
        "to running on them, which allocates them), or keep the forward's shapes "
        "independent of the data (pad to a fixed size; pass numbers as configuration)"
    )


def sampled_on_meta(sampler: Callable[[int], Any], b: int, run: Callable[[Any], T]) -> T:
    """``run(sampler(b))`` with the batch drawn under ``torch.device("meta")``.

    A sampler that builds its batch with torch's factories (``torch.randint``,
    ``torch.randn``...) then allocates nothing, whatever ``b``. When drawing on
    meta fails, or ``run`` raises :class:`ShapesOnlyError` (the forward needs
    values), the batch is drawn again for real and ``run`` called on it (logged).

    Example::

        >>> sampled_on_meta(lambda b: torch.zeros(b, 3), 10**9, lambda x: x.is_meta)
        True
    """
    try:
        with torch.device("meta"):
            batch = sampler(b)
    except Exception as exc:
        log.warning(
            "drawing the sample batch (%d) on the meta device failed (%s: %s); drawing it "
            "with real tensors",
            b,
            type(exc).__name__,
            first_line(exc),
        )
        return run(sampler(b))
    try:
        return run(batch)
    except ShapesOnlyError as exc:
        if has_real(None, batch):
            raise
        log.warning("%s; drawing the batch (%d) with real tensors", first_line(exc), b)
        return run(sampler(b))
