"""Building this rank's stage without the whole model: parameters on meta, filled by name.

[Note: building a stage without the whole model]
A full build gives every rank every parameter: host memory O(model) per rank,
eight copies on an eight-GPU node, and a model larger than one host's memory
cannot start. With ``--init-from PATH`` (``ParallelModel.from_plan(...,
init_from=PATH)``) a worker instead

1. builds the model under :func:`meta_parameters`: every parameter on the
   meta device (shape and dtype, no storage), every buffer real (buffers are
   the model's constants, e.g. a rotary ``inv_freq``; the constructor computes
   them, and a pretrained file usually lacks the non-persistent ones);
2. checks the plan's fingerprint, finds the tied sets and splits the model as
   usual: all of it needs names, shapes and identity only (the example
   micro-batch is a meta copy, the buffers are moved to meta first);
3. gives only this rank's stage storage, on its device, and fills every
   tensor of it by name from PATH (:class:`StageWeights`): a safetensors file
   (read straight into the stage's tensors, one at a time, no second copy) or
   a DCP folder (one partial ``dcp.load`` of the stage's keys; a checkpoint
   step folder of this runtime gives its ``model/`` weights). A tied weight
   is found under any of its names, on every stage that holds a copy.

So a rank holds its stage plus the model's buffers. :func:`save_initial_weights`
(``planner init-weights``) writes the file a full build with the run's seed
would start from: every parameter and buffer, by name, each tensor once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from runtime.weights import open_weights

__all__ = [
    "StageWeights",
    "meta_parameters",
    "save_initial_weights",
    "stage_weights",
    "write_weights",
]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Build a model whose parameters are on the meta device (no storage); buffers stay real.

    Example::

        torch.manual_seed(0)
        with meta_parameters():
            model = build_model()          # model.fc.weight.is_meta; buffers real

    Every parameter a module registers (``self.weight = nn.Parameter(...)``)
    is replaced by a meta one at once, so the initialisers that follow run on
    meta (free) and a parameter's storage lives only while its constructor
    runs. A tensor registered twice stays one tensor (ties keep); a subclass of
    ``nn.Parameter`` stays real (it is filled from the file all the same).
    """
    original = nn.Module.register_parameter
    moved: dict[int, tuple[weakref.ref[Tensor], nn.Parameter]] = {}  # id(real) -> its meta

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta and type(param) is nn.Parameter:
            seen = moved.get(id(param))
            if seen is None or seen[0]() is not param:  # (a dead tensor's id may come back)
                meta = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
                meta.__dict__.update(param.__dict__)
                seen = moved[id(param)] = (weakref.ref(param), meta)
            param = seen[1]
        original(self, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def write_weights(model: nn.Module, path: str | os.PathLike[str]) -> Path:
    """Write every parameter and buffer of ``model`` to a safetensors file, each tensor once.

    Example::

        write_weights(model, "init.safetensors")

    Non-persistent buffers (not in ``state_dict``) are included; a tied tensor
    is written under its first name (a stage holding it under another finds it
    through the model's aliases).
    """
    from safetensors.torch import save_file

    tensors: dict[str, Tensor] = {}
    storages: set[int] = set()  # safetensors refuses two tensors on one storage: copy the later
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        t = t.detach().cpu().contiguous()
        where = t.untyped_storage().data_ptr()
        tensors[name] = t.clone() if where in storages and t.numel() else t
        storages.add(where)
    path = Path(path)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def save_initial_weights(
    model_file: str | os.PathLike[str], path: str | os.PathLike[str], *, seed: int = 0
) -> Path:
    """The initial weights of a run with ``--seed seed``, as a file for ``--init-from``.

    Example::

        save_initial_weights("examples/gpt.py", "gpt-init.safetensors", seed=0)
        # planner run examples/gpt.py --plan plan.yaml --init-from gpt-init.safetensors

    Builds the model exactly as a worker does without ``--init-from`` (torch's
    seed, then ``build_model()``): a run started from the file trains the same
    losses. This one build holds the whole model (on this machine, once).
    """
    from planner.plan.modelfile import load_model_file

    mf = load_model_file(model_file)
    torch.manual_seed(seed)
    return write_weights(mf.build(), path)


def stage_weights(
    init_from: str | os.PathLike[str] | None, model: nn.Module, example: Any
) -> tuple[StageWeights | None, Any]:
    """``--init-from``'s :class:`StageWeights`, and the example as the split must trace it.

    Example::

        weights, example = stage_weights(opts.init_from, model, example)  # (None, example)
        stage = build_stage(model, plan, mesh, example, materialize=weights)  # without it
    """
    if init_from is None:
        return None, example
    weights = StageWeights(init_from, model)
    return weights, weights.example(example)


class StageWeights:
    """Where a meta-built model's stage gets its values: a weights file by name, and its buffers.

    Example::

        with meta_parameters():
            model = build_model()
        weights = StageWeights("init.safetensors", model)  # buffers moved to meta, kept here
        stage = build_stage(model, plan, mesh, weights.example(ex), materialize=weights)

    Args:
        path: a ``.safetensors`` file or a DCP folder (see the module's note).
        model: the whole model; its tensors may be meta or real.

    Raises:
        ValueError: ``path`` is neither (the message says what it is).
    """

    def __init__(self, path: str | os.PathLike[str], model: nn.Module) -> None:
        self.path = Path(path)
        self._file = open_weights(self.path)
        self._aliases = _aliases(model)
        self._meta = any(p.is_meta for p in model.parameters())
        self._constants = _take_buffers(model) if self._meta else {}

    def example(self, example: Any) -> Any:
        """``example`` as meta tensors when the model is on meta (what the split traces)."""
        if not self._meta:
            return example
        return pytree.tree_map_only(Tensor, lambda t: t.to("meta"), example)

    def __call__(self, module: nn.Module, device: torch.device) -> None:
        """Give ``module``'s tensors storage on ``device`` and fill them by name (ties kept).

        ``build_stage(..., materialize=weights)`` calls it on this rank's stage module.

        Raises:
            ValueError: a tensor of the stage is in neither the file nor the
                model's buffers, or has another shape there (all are listed).
        """
        slots: dict[int, list[tuple[str, str]]] = {}  # id(tensor) -> [(name, "p" | "b")]
        first: dict[int, Tensor] = {}
        for kind, items in (
            ("p", module.named_parameters(remove_duplicate=False)),
            ("b", module.named_buffers(remove_duplicate=False)),
        ):
            for name, t in items:
                slots.setdefault(id(t), []).append((name, kind))
                first.setdefault(id(t), t)
        wanted: dict[str, Tensor] = {}  # file key -> the tensor read from it
        again: list[tuple[str, Tensor]] = []  # another copy of one key (T5: two in a stage)
        fresh: dict[int, Tensor] = {}
        missing: list[str] = []
        for key, old in first.items():
            fresh[key] = new = torch.empty(old.shape, dtype=old.dtype, device=device)
            found = self._find([name for name, _ in slots[key]])
            if found is not None and found[0] == "file":
                if found[1] in wanted:
                    again.append((found[1], new))
                else:
                    wanted[found[1]] = new
            elif found is not None:
                new.copy_(self._constants[found[1]])
            elif not old.is_meta:
                new.copy_(old)
            else:
                missing.append(slots[key][0][0])
        if missing:
            raise ValueError(
                f"{len(missing)} tensor(s) of this stage are not in {self.path}: "
                f"{missing[:8]}{' …' if len(missing) > 8 else ''}; the stage needs every "
                "parameter and buffer it reads.\n  fix: write the file from this model file "
                "(`planner init-weights MODEL --out FILE`), or use a checkpoint whose names "
                "match the model's (model.named_parameters())"
            )
        self._file.load(wanted)
        for file_key, copy in again:
            copy.copy_(wanted[file_key])
        for key, places in slots.items():
            old = first[key]
            value: Tensor = fresh[key]
            if isinstance(old, nn.Parameter):
                value = nn.Parameter(value, requires_grad=old.requires_grad)
            for name, kind in places:
                owner, _, leaf = name.rpartition(".")
                sub = module.get_submodule(owner)
                store: dict[str, Any] = sub._parameters if kind == "p" else sub._buffers
                store[leaf] = value
        log.info("stage materialised on %s: %d tensors from %s", device, len(wanted), self.path)

    def values(self, templates: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """CPU values of the model's tensors ``templates`` (name → meta or real tensor).

        A name found nowhere is left out when its template is meta (logged).
        """
        out: dict[str, Tensor] = {}
        wanted: dict[str, Tensor] = {}
        for name, t in templates.items():
            found = self._find(list(self._aliases.get(name, (name,))))
            if found is not None and found[0] == "file":
                out[name] = wanted.setdefault(found[1], torch.empty(t.shape, dtype=t.dtype))
            elif found is not None:
                out[name] = self._constants[found[1]].clone()
            elif not t.is_meta:
                out[name] = t.detach().cpu().clone()
            else:
                log.warning("%s is read by no stage and not in %s: left out", name, self.path)
        self._file.load(wanted)
        return out

    def _find(self, names: list[str]) -> tuple[str, str] | None:
        """("file", key) or ("buffer", name) of the first source that has one of ``names``."""
        every = list(dict.fromkeys(a for n in names for a in self._aliases.get(n, (n,))))
        for n in every:
            key = self._file.key(n)
            if key is not None:
                return ("file", key)
        for n in every:
            if n in self._constants:
                return ("buffer", n)
        return None


def _aliases(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Every parameter or buffer name → all names of the same tensor, in model order."""
    by_id: dict[int, list[str]] = {}
    for name, t in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        by_id.setdefault(id(t), []).append(name)
    return {n: tuple(names) for names in by_id.values() for n in names}


def _take_buffers(model: nn.Module) -> dict[str, Tensor]:
    """Move ``model``'s real buffers to meta (ties kept); returns their values by every name."""
    kept: dict[str, Tensor] = {}
    meta: dict[int, Tensor] = {}
    for name, b in list(model.named_buffers(remove_duplicate=False)):
        if b.is_meta:
            continue
        owner, _, leaf = name.rpartition(".")
        kept[name] = b.detach()
        model.get_submodule(owner)._buffers[leaf] = meta.setdefault(id(b), b.to("meta"))
    return kept
