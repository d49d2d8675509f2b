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
(``runtime.safeload``). A checkpoint holding any other pickled object is
refused, before it can run.
"""

# [Note: exact resume]
#
# N steps straight and N/2 steps, save, a new process (group), load, N/2 steps
# end with the same weights and optimizer state, bit for bit, because every
# input of step n is restored or recomputed:
#   * weights and optimizer state (Adam's moments and step count): saved;
#   * the batch of step n: a function of n only (runtime.launch seeds the
#     model file's sample_batch with `seed + n`);
#   * randomness inside the step (dropout): `seed_step` seeds each rank's RNG
#     from (seed, stage, replica, step) before the step (reliability item 23),
#     so masks do not depend on what ran before; the saved RNG state covers
#     training loops that do not call it.
# Bit-exactness also needs the same plan, world size and thread counts (the
# order of floating-point sums), which `load` checks for the layout.

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from runtime.safeload import (
    METADATA,
    Refused,
    SafeLoadPlanner,
    SafeReader,
    read_metadata,
    refusal,
    refused_message,
)

if TYPE_CHECKING:
    from planner.plan import Plan
    from runtime.engine import ParallelModel

__all__ = [
    "COMPLETE",
    "FORMAT",
    "METADATA",
    "checkpoint_path",
    "incomplete_reason",
    "latest_complete",
    "load",
    "read_marker",
    "save",
    "seed_step",
    "step_seed",
]

log = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
"""The completion marker's file name inside a checkpoint folder."""

FORMAT = 2
"""Version of the layout above, recorded in the marker (2: with the files' sizes)."""

_NAME = re.compile(r"step-(\d{8,})")
_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)
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
            have = (path / name).stat().st_size
        except OSError:
            return f"{name} is missing (the {COMPLETE} marker lists it)"
        if have != size:
            return (
                f"{name} has {have} bytes, its save wrote {size} (cut short, or overwritten "
                "after the save)"
            )
    return None


def _load_marker(path: str | os.PathLike[str]) -> tuple[dict[str, Any] | None, str]:
    """(the marker, "") or (None, why there is no valid one)."""
    marker = Path(path) / COMPLETE
    try:
        data = json.loads(marker.read_text())
    except FileNotFoundError:
        return None, f"it has no {COMPLETE} marker (its save did not finish)"
    except (OSError, ValueError) as exc:
        return None, f"its {COMPLETE} marker is unreadable ({exc})"
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

    Returns:
        The checkpoint folder.
    """
    path = checkpoint_path(directory, step)
    rank = dist.get_rank()
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        (path / COMPLETE).unlink(missing_ok=True)
    _barrier(pmodel)
    started = time.perf_counter()
    dcp.save(_state(pmodel, step), checkpoint_id=path)
    _barrier(pmodel)  # every rank's files are written
    if rank == 0:
        marker = _marker(pmodel.plan, dist.get_world_size(), step)
        marker["files"] = _file_sizes(path)
        _write_marker(path, marker)
    _barrier(pmodel)
    log.info(
        "%s checkpoint %s saved in %.2f s", pmodel.mesh.prefix, path, time.perf_counter() - started
    )
    return path


def _state(pmodel: ParallelModel, step: int) -> dict[str, Any]:
    """This rank's part of a checkpoint (see the module docstring); tensors are live, not copies."""
    mesh = pmodel.mesh
    state: dict[str, Any] = {
        "model": pmodel.stage_state_dict(),
        "step": torch.tensor(step, dtype=torch.int64),
        "rng": {f"rank{mesh.rank}": _rng_state(mesh.device)},
    }
    if pmodel.optimizer is not None:
        state["optim"] = get_optimizer_state_dict(
            pmodel.stage.module, pmodel.optimizer, options=_OPTIM
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
        "pp": plan.pp,
        "dp": plan.dp,
        "world_size": world_size,
        "split_points": plan.split_points,
        "ranks": plan.ranks(),
        "layout_digest": _layout_digest(plan),
        "model_file": str(plan.model.get("file") or ""),
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


def _write_marker(path: Path, data: dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{COMPLETE}.", suffix=".tmp", dir=path)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path / COMPLETE)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _barrier(pmodel: ParallelModel) -> None:
    device = pmodel.mesh.device
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


# --------------------------------------------------------------------------- load


def load(pmodel: ParallelModel, path: str | os.PathLike[str], *, reshard: bool = False) -> int:
    """Restore a checkpoint into the running model; a collective. Returns the step it was saved at.

    Example::

        path = latest_complete("ckpt")
        start = load(pmodel, path) if path else 0
        for step in range(start, total): ...

    Restores this rank's stage weights, optimizer state and RNG state, in
    place. Call it after ``ParallelModel.from_plan`` and before training.

    Args:
        path: a checkpoint folder (``directory/step-N``) with a COMPLETE marker.
        reshard: load a checkpoint saved with another layout (pp, dp, split
            points, world size) of the same model: weights and optimizer state
            are matched by parameter name; RNG states are not restored (each
            belonged to a rank of the old layout), and the result is not
            bit-identical to an uninterrupted run of either layout.

    Raises:
        ValueError: the folder is not a complete checkpoint; it was saved for
            another model; or for another layout and ``reshard`` is False;
            or (resharding) this layout needs a parameter the checkpoint lacks.
            Raised on every rank with the same message, before anything is read.
    """
    path = Path(path)
    reason = incomplete_reason(path)
    if reason is not None:
        raise ValueError(
            f"checkpoint {path} is not complete: {reason}.\n  fix: resume from "
            "latest_complete(directory), which skips incomplete checkpoints"
        )
    marker = read_marker(path)
    plan = pmodel.plan
    world = dist.get_world_size()
    if marker["fingerprint"] != plan.fingerprint:
        raise ValueError(
            f"checkpoint {path} was saved for another model: fingerprint "
            f"{marker['fingerprint']} in the checkpoint, {plan.fingerprint} in the running "
            f"plan ({marker.get('model_file') or 'model file unknown'} then).\n  fix: resume "
            "with the model it was saved from, or start fresh with another checkpoint directory"
        )
    differ = _layout_differences(marker, plan, world)
    if differ and not reshard:
        raise ValueError(
            f"checkpoint {path} was saved with another layout: {'; '.join(differ)}.\n"
            f"  fix: resume with the plan it was saved with (pp {marker['pp']} × dp "
            f"{marker['dp']}, split points {marker['split_points']}, {marker['world_size']} "
            "processes); or load it into this layout by name with reshard=True (`--reshard`: "
            "weights and optimizer state, not RNG streams); or start fresh with another "
            "checkpoint directory"
        )
    try:
        metadata = read_metadata(path)
    except Refused as exc:
        raise ValueError(refused_message(path, str(exc))) from None
    state = _state(pmodel, 0)
    if differ:
        del state["rng"]
    try:
        dcp.load(state, storage_reader=SafeReader(path, metadata), planner=SafeLoadPlanner())
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        refused = refusal(exc)
        if refused is not None:
            raise ValueError(refused_message(path, refused)) from exc
        if not differ:
            raise
        raise ValueError(
            f"cannot reshard checkpoint {path} into this layout ({'; '.join(differ)}): "
            f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}\n  fix: resume "
            "with the plan it was saved with"
        ) from exc
    if pmodel.optimizer is not None:
        set_optimizer_state_dict(
            pmodel.stage.module, pmodel.optimizer, state["optim"], options=_OPTIM
        )
    if "rng" in state:
        rng = state["rng"][f"rank{pmodel.mesh.rank}"]
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"], pmodel.mesh.device)
    step = int(state["step"].item())
    log.info(
        "%s resumed from %s (step %d%s)",
        pmodel.mesh.prefix,
        path,
        step,
        ", resharded" if differ else "",
    )
    return step


def _layout_differences(marker: dict[str, Any], plan: Plan, world: int) -> list[str]:
    now = {
        "pp": plan.pp,
        "dp": plan.dp,
        "world size": world,
        "split points": plan.split_points,
        "ranks": plan.ranks(),
    }
    then = {
        "pp": marker.get("pp"),
        "dp": marker.get("dp"),
        "world size": marker.get("world_size"),
        "split points": marker.get("split_points"),
        "ranks": marker.get("ranks"),
    }
    return [f"{k} {then[k]} in the checkpoint, {v} now" for k, v in now.items() if then[k] != v]


# --------------------------------------------------------------------------- seeding


def step_seed(seed: int, step: int, stage: int, replica: int) -> int:
    """A 63-bit seed from (seed, stage, replica, step): distinct streams, reproducible.

    >>> step_seed(0, 5, 1, 0) == step_seed(0, 5, 1, 0) != step_seed(0, 5, 1, 1)
    True
    """
    digest = hashlib.sha256(f"{seed}/{stage}/{replica}/{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seed_step(pmodel: ParallelModel, step: int, seed: int = 0) -> None:
    """Seed this rank's RNG for training step ``step`` (see [Note: exact resume]).

    Example::

        for step in range(start, total):
            seed_step(pmodel, step, seed=0)
            loss = pmodel.step(x, y)

    Dropout masks then depend on (seed, stage, replica, step) only: replicas
    draw different masks, and a resumed run draws the masks the uninterrupted
    run drew (reliability item 23). Bit-exact parity with ONE process still
    needs dropout off: one process draws one mask for the whole batch.
    """
    torch.manual_seed(step_seed(seed, step, pmodel.mesh.stage, pmodel.mesh.replica))
