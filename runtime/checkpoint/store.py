"""Checkpoints of a running plan with ``torch.distributed.checkpoint`` (DCP): save, find, resume.

Layout of ``directory`` (one folder per saved step)::

    directory/
      step-00000200/            DCP's files: every rank writes its own part
        .metadata               (DCP's index, written last by rank 0)
        __0_0.distcp  __1_0.distcp  ...
        COMPLETE                JSON, written by rank 0 after every rank finished
      step-00000400/ ...

What each rank saves (DCP merges the ranks' dicts by key; a key held by
several ranks, e.g. a stage's weights in every replica, is written once):

``model/<name>``       this stage's parameters and persistent buffers under the
                       model's names (a tied weight under its first name);
``optim/...``          this stage's optimizer state, flattened by parameter name
                       (``torch.distributed.checkpoint.state_dict``);
``rng/rank<r>/...``    this rank's torch RNG state (CPU, and its CUDA device);
``step``               the number of optimizer steps done.

Only a folder with a ``COMPLETE`` marker is a checkpoint: a save that crashed
leaves no marker and :func:`latest_complete` skips it (reliability item 25).
The marker also records the size of every file of the folder, so a file cut
short afterwards (a full disk, a copy that stopped half-way) is found too; a
checkpoint with a missing or short file is skipped the same way, with a
warning that names the folder and the file. The marker records the model's
fingerprint and the layout (pp, dp, world size, split points, ranks);
:func:`load` refuses a checkpoint of another layout unless asked to reshard,
and one of another model always (item 26).

Checkpoints are trusted inputs (like the model file), but nothing here unpickles
arbitrary objects (item 27): tensors and the few non-tensor values (optimizer
hyper-parameters) are read with ``torch.load(weights_only=True)``, and DCP's
index (``.metadata``, a plain pickle that DCP itself reads with ``pickle.load``)
through an unpickler that accepts DCP's own metadata classes and nothing else
(``runtime.checkpoint.safeload``). A checkpoint holding any other pickled object is
refused, before it can run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from planner.plan.files import atomic_write
from planner.plan.schema import Plan
from runtime.checkpoint.files import MAX_MARKER_BYTES, Malformed, Missing, regular_file_in
from runtime.checkpoint.safeload import METADATA
from runtime.fsdp import local
from runtime.stage import rank_module

if TYPE_CHECKING:
    from runtime.engine import ParallelModel

__all__ = [
    "COMPLETE",
    "FORMAT",
    "OPTIM_OPTIONS",
    "STRUCTURAL",
    "barrier",
    "checkpoint_path",
    "incomplete_reason",
    "latest_complete",
    "rank_state",
    "read_marker",
    "save",
]

log = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
"""The completion marker's file name inside a checkpoint folder."""

FORMAT = 2
"""Version of the layout above, recorded in the marker (2: with the files' sizes)."""

STRUCTURAL = "structural"
"""The marker's ``fingerprint_kind`` when its fingerprint is the model's structural one
(``planner.plan.fingerprint``). Markers without it recorded a hash of the traced graph,
which nothing computes any more: their model is checked by its parameters' names and
shapes only (DCP's load matches them)."""

_NAME = re.compile(r"step-(\d{8,})")
OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
"""How optimizer state is saved and loaded: flattened by parameter name."""
_warned: set[str] = set()  # incomplete checkpoints already reported (warn once per path)


# --------------------------------------------------------------------------- paths


def checkpoint_path(directory: str | os.PathLike[str], step: int) -> Path:
    """``directory/step-00000042``: where the checkpoint after ``step`` steps lives."""
    return Path(directory) / f"step-{step:08d}"


def read_marker(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``COMPLETE`` marker of checkpoint folder ``path``.

    Raises:
        ValueError: there is no marker (the save did not finish), or it is not
            a marker this runtime wrote.
    """
    data, reason = _load_marker(path)
    if data is None:
        raise ValueError(
            f"checkpoint {path} is not complete: {reason}.\n  fix: resume from "
            "latest_complete(directory), which skips incomplete checkpoints"
        )
    return data


def incomplete_reason(path: str | os.PathLike[str], step: int | None = None) -> str | None:
    """Why checkpoint folder ``path`` is not a complete checkpoint; None when it is one.

    Example::

        incomplete_reason("ckpt/step-00000400")
        # '__1_0.distcp has 100 bytes, its save wrote 20544 (cut short, or ...)'

    Complete: a valid ``COMPLETE`` marker (of ``step``, when given) and every
    file the marker lists, of the size it records (DCP's ``.metadata`` among
    them). No communication, and nothing is unpickled.
    """
    path = Path(path)
    marker, reason = _load_marker(path)
    if marker is None:
        return reason
    if step is not None and marker.get("step") != step:
        return f"its {COMPLETE} marker is of step {marker.get('step')}, not {step}"
    files = marker.get("files")
    if not isinstance(files, dict) or METADATA not in files:
        return f"its {COMPLETE} marker lists no files (or not DCP's {METADATA})"
    for name, size in sorted(files.items()):
        try:
            have = regular_file_in(path, name)[1]
        except Missing:
            return f"{name} is missing (the {COMPLETE} marker lists it)"
        except Malformed as exc:
            return f"its {COMPLETE} marker is not this runtime's: {exc}"
        if have != size:
            return (
                f"{name} has {have} bytes, its save wrote {size} (cut short, or overwritten "
                "after the save)"
            )
    return None


def _load_marker(path: str | os.PathLike[str]) -> tuple[dict[str, Any] | None, str]:
    """(the marker, "") or (None, why there is no valid one)."""
    try:
        marker, size = regular_file_in(
            Path(path), COMPLETE, max_bytes=MAX_MARKER_BYTES, who="the marker is"
        )
        with open(marker, "rb") as f:
            data = json.loads(f.read(size + 1))
    except Missing:
        return None, f"it has no {COMPLETE} marker (its save did not finish)"
    except Malformed as exc:
        return None, f"its {COMPLETE} marker is refused: {exc}"
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        return None, f"its {COMPLETE} marker is unreadable ({type(exc).__name__}: {exc})"
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        return None, (
            f"its {COMPLETE} marker is not of format {FORMAT} (got {got!r}): not saved by "
            "this version of the runtime"
        )
    return data, ""


def latest_complete(directory: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint in ``directory``, or None when there is none.

    Example::

        path = latest_complete("ckpt")       # e.g. ckpt/step-00000400
        start = load(pmodel, path) if path else 0

    A ``step-N`` folder that is not complete (see :func:`incomplete_reason`: a
    save that crashed, a file cut short) is skipped with a warning naming it
    and why, once per folder. No communication: every rank may call it (on a
    shared file system they agree).
    """
    root = Path(directory)
    if not root.is_dir():
        return None
    found = []
    for p in root.iterdir():
        m = _NAME.fullmatch(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    for step, p in sorted(found, reverse=True):
        reason = incomplete_reason(p, step)
        if reason is None:
            return p
        if str(p) not in _warned:
            _warned.add(str(p))
            log.warning(
                "skipping incomplete checkpoint %s: %s; looking for an earlier one", p, reason
            )
    return None


# --------------------------------------------------------------------------- save


def save(pmodel: ParallelModel, directory: str | os.PathLike[str], step: int) -> Path:
    """Save every rank's stage after ``step`` optimizer steps; a collective (call on every rank).

    Example::

        if (step + 1) % 100 == 0:
            save(pmodel, "ckpt", step + 1)

    Writes ``directory/step-{step:08d}/`` with DCP, then, only after every rank
    has finished writing, rank 0 writes the ``COMPLETE`` marker (a temporary
    file renamed into place). Returns when the checkpoint is complete, on
    every rank. An existing folder of the same step is overwritten (its marker
    is removed first, so it is never complete while half rewritten).

    Nothing non-finite is ever saved: every rank first checks its stage's
    weights and optimizer state, and if any rank finds a NaN or an infinity,
    every rank refuses (a collective flag) before anything is written.

    Returns:
        The checkpoint folder.

    Raises:
        ValueError: a weight or optimizer state tensor is NaN or infinite on some rank.
    """
    _refuse_nonfinite(pmodel, step)
    path = checkpoint_path(directory, step)
    rank = dist.get_rank()
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        (path / COMPLETE).unlink(missing_ok=True)
    barrier(pmodel)
    started = time.perf_counter()
    dcp.save(rank_state(pmodel, step), checkpoint_id=path)
    barrier(pmodel)  # every rank's files are written
    if rank == 0:
        marker = _marker(pmodel.plan, dist.get_world_size(), step)
        marker["files"] = _file_sizes(path)
        atomic_write(path / COMPLETE, json.dumps(marker, indent=1), durable=True)
    barrier(pmodel)
    log.info(
        "%s checkpoint %s saved in %.2f s", pmodel.mesh.prefix, path, time.perf_counter() - started
    )
    return path


def _refuse_nonfinite(pmodel: ParallelModel, step: int) -> None:
    """Raise on every rank if any rank's weights or optimizer state are not finite."""
    bad = [k for k, v in pmodel.stage_state_dict().items() if _nonfinite(v)]
    if pmodel.optimizer is not None:
        for state in pmodel.optimizer.state.values():
            bad += [f"optimizer {k}" for k, v in state.items() if _nonfinite(v)]
    flag = torch.tensor([float(len(bad))], device=pmodel.mesh.device)
    if dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() > 0:
        where = f"{len(bad)} here: {bad[:3]}" if bad else "on another rank"
        raise ValueError(
            f"refusing to save the checkpoint of step {step}: tensors are NaN or infinite "
            f"({where}); a checkpoint of them would poison every resume.\n  fix: resume "
            "from the last good checkpoint with a lower learning rate or --clip-grad-norm"
        )


def _nonfinite(value: Any) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and not bool(torch.isfinite(local(value)).all())  # FSDP: this rank's shard
    )


def rank_state(pmodel: ParallelModel, step: int) -> dict[str, Any]:
    """This rank's part of a checkpoint (see the module docstring); tensors are live, not copies."""
    mesh = pmodel.mesh
    state: dict[str, Any] = {
        "model": pmodel.stage_state_dict(),
        "step": torch.tensor(step, dtype=torch.int64),
        "rng": {f"rank{mesh.rank}": _rng_state(mesh.device)},
    }
    if pmodel.optimizer is not None:
        state["optim"] = get_optimizer_state_dict(
            rank_module(pmodel.stages), pmodel.optimizer, options=OPTIM_OPTIONS
        )
    return state


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _marker(plan: Plan, world_size: int, step: int) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "step": step,
        "fingerprint": plan.fingerprint,
        "fingerprint_kind": STRUCTURAL if plan.fingerprint else None,
        "pp": plan.pp,
        "dp": plan.dp,
        "world_size": world_size,
        "split_points": plan.split_points,
        "ranks": plan.ranks(),
        "layout_digest": _layout_digest(plan),
        "model_file": plan.model.file,
        "torch": torch.__version__,
        "saved_unix_s": round(time.time(), 3),
    }


def _file_sizes(path: Path) -> dict[str, int]:
    """Every file of a checkpoint folder but the marker (and its temporaries): name → bytes."""
    return {
        p.name: p.stat().st_size
        for p in sorted(path.iterdir())
        if p.is_file() and p.name != COMPLETE and not p.name.startswith(f".{COMPLETE}.")
    }


def _layout_digest(plan: Plan) -> str:
    text = json.dumps([plan.pp, plan.dp, plan.split_points, plan.ranks()])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def barrier(pmodel: ParallelModel) -> None:
    """Every rank of the job here (a collective)."""
    device = pmodel.mesh.device
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()
