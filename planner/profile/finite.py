"""Whether a model's outputs and loss are finite on the sample: a plan of a NaN model is a warning.

A measured profile runs the model on real values, but times are all it keeps:
a forward that returns NaN (a bad initialisation, ``log(0)``, an overflowing
``exp``) plans like any other, and the run then trains on NaN gradients.
:func:`nonfinite_warning` runs one forward and the loss on the sample, with a
forward hook on every module, and names the first module whose output was not
finite.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from planner.plan.text import first_line
from planner.profile.meta import has_real
from planner.profile.state import preserved

__all__ = ["nonfinite_warning"]

log = logging.getLogger(__name__)

Sampler = Callable[[int], tuple[tuple[Any, ...], dict[str, Any], Any]]


def _nonfinite(value: Any) -> bool:
    return any(
        isinstance(t, torch.Tensor)
        and not t.is_meta
        and (t.is_floating_point() or t.is_complex())
        and not bool(torch.isfinite(t).all())
        for t in tree_leaves(value)
    )


def nonfinite_warning(
    model: nn.Module,
    sampler: Sampler,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    batch_size: int,
) -> str | None:
    """The plan's warning when the forward or the loss gives NaN or inf on the sample, else None.

    Example::

        warning = nonfinite_warning(model, sampler, F.cross_entropy, 2)

    One forward (no gradients) and the loss on ``sampler(batch_size)``; the
    model is left as found. Nothing is checked for meta tensors (no values),
    and a forward that raises here is not this check's to report (the
    profile ran it already).
    """
    if not has_real(model):
        return None
    names = {id(m): name for name, m in model.named_modules()}
    first: list[str] = []

    def hook(module: nn.Module, _inputs: Any, output: Any) -> None:
        if not first and _nonfinite(output):
            first.append(f"module '{names.get(id(module)) or '<root>'}' ({type(module).__name__})")

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        args, kwargs, targets = sampler(batch_size)
        if not has_real(None, args, kwargs):
            return None
        with preserved(model), torch.no_grad():
            out = model(*args, **kwargs)
            loss = loss_fn(out, targets) if loss_fn is not None else None
    except Exception as exc:
        log.debug("finite check skipped: %s: %s", type(exc).__name__, first_line(exc))
        return None
    finally:
        for h in handles:
            h.remove()
    at = f"on the sample micro-batch of {batch_size}"
    if first:
        what = f"the model's outputs are not finite (NaN or inf) {at}: first in the output of "
        what += first[0]
    elif loss is not None and _nonfinite(loss):
        what = f"the loss is {float(loss.detach().float().sum())} {at}, from finite outputs"
    else:
        return None
    return (
        f"{what}; training on this plan would step on NaN gradients. Check that module's "
        "initialisation and inputs (sample_batch's values; log or sqrt of zero or negatives, "
        "a division by zero, an exp that overflows), and loss_fn"
    )
