"""The model's identity: a structural fingerprint, and what differs when two do not match.

The fingerprint hashes the model's structure and nothing that a run changes:

* the module tree: every submodule's name and class (``module.Class``);
* every parameter and buffer: its name, shape and dtype (tied parameters
  under each of their names), and which names are one tensor.

No trace, no forward pass: it is the same on every rank, at every batch size,
and whatever code path the forward takes (a library's mask code at batch 1).
It ignores values (two initialisations of one architecture agree) and
``requires_grad``. A model file's classes are named by their class alone (the
file is imported under a private module name made from its path: see
:mod:`planner.plan.modelfile`), so a copy of the file elsewhere agrees too.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import TYPE_CHECKING

from planner.plan.modelfile import MODULE_PREFIX
from planner.plan.text import few

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["describe_mismatch", "fingerprint", "parameter_shapes"]


def fingerprint(model: nn.Module) -> str:
    """16 hex digits of a hash of ``model``'s structure (see the module docstring).

    Example::

        >>> fingerprint(nn.Linear(2, 3)) == fingerprint(nn.Linear(2, 3))  # doctest: +SKIP
        True
    """
    h = hashlib.sha256()
    for name, module in model.named_modules(remove_duplicate=False):
        h.update(f"m|{name}|{_class_name(type(module))};".encode())
    first: dict[int, str] = {}
    state: list[tuple[str, str, torch.Tensor]] = [
        ("p", n, t) for n, t in model.named_parameters(remove_duplicate=False)
    ]
    state += [("b", n, t) for n, t in model.named_buffers(remove_duplicate=False)]
    for kind, name, t in state:
        same = first.setdefault(id(t), name)  # tied: the first name of the same tensor
        h.update(f"{kind}|{name}|{tuple(t.shape)}|{t.dtype}|{same};".encode())
    return h.hexdigest()[:16]


def parameter_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every parameter name (tied ones under each name) and its shape."""
    return {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}


def describe_mismatch(want: Mapping[str, tuple[int, ...]], model: nn.Module) -> list[str]:
    """What differs between the parameters a plan records and ``model``'s, line by line.

    Empty when every name and shape agrees (the difference, if any, is then in
    the module tree, a buffer or a dtype).
    """
    have = parameter_shapes(model)
    missing = [n for n in want if n not in have]
    extra = [n for n in have if n not in want]
    reshaped = [n for n in want if n in have and tuple(have[n]) != tuple(want[n])]
    lines = []
    if missing:
        lines.append(
            f"{len(missing)} parameter(s) in the plan are missing from the model: {few(missing)}"
        )
    if extra:
        lines.append(f"{len(extra)} parameter(s) of the model are not in the plan: {few(extra)}")
    if reshaped:
        shown = [f"{n} {list(want[n])} in the plan, {list(have[n])} here" for n in reshaped]
        lines.append(f"{len(reshaped)} parameter(s) have other shapes: {few(shown)}")
    return lines


def _class_name(cls: type) -> str:
    module = cls.__module__
    if module.startswith(MODULE_PREFIX):
        return cls.__qualname__  # a model file: its module name depends on its path
    return f"{module}.{cls.__qualname__}"
