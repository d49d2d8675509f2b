"""Resuming from a checkpoint: the checks, the restore, and the seeds that make it exact.

:func:`load` refuses a checkpoint of another model always, and of another
layout unless asked to reshard (reliability item 26); nothing it reads can
run code (item 27, :mod:`runtime.checkpoint.safeload`). :func:`seed_step`
seeds each rank per step, so a resumed run draws the dropout masks the
uninterrupted run drew.
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
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

from planner.plan.schema import Plan
from planner.plan.text import first_line
from runtime.checkpoint.safeload import CheckpointRefused, load_state
from runtime.checkpoint.store import (
    OPTIM_OPTIONS,
    STRUCTURAL,
    incomplete_reason,
    rank_state,
    read_marker,
)
from runtime.stage import rank_module

if TYPE_CHECKING:
    from runtime.engine import ParallelModel

__all__ = ["load", "seed_step", "step_seed"]

log = logging.getLogger(__name__)


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
            or (resharding) this layout needs a parameter the checkpoint lacks;
            or (``CheckpointRefused``) it holds code, or its index points outside
            its folder, at something not a regular file, or past a file's end.
            Raised on every rank with the same message, before anything is read.
    """
    path = Path(path)
    reason = incomplete_reason(path)
    if reason is not None:
        raise ValueError(
            f"checkpoint {path} is not complete: {reason}.\n  fix: resume from "
            "latest_complete(directory), which skips incomplete checkpoints"
        )
    differ = _refusal_or_differences(path, read_marker(path), pmodel.plan, reshard)
    state = rank_state(pmodel, 0)
    if differ:
        del state["rng"]
    try:
        load_state(path, state)
    except CheckpointRefused:  # crafted or damaged: the message says what to do
        raise
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        if not differ:
            raise
        raise ValueError(
            f"cannot reshard checkpoint {path} into this layout ({'; '.join(differ)}): "
            f"{type(exc).__name__}: {first_line(exc)[:300]}\n  fix: resume "
            "with the plan it was saved with"
        ) from exc
    _restore(pmodel, state)
    step = int(state["step"].item())
    log.info(
        "%s resumed from %s (step %d%s)",
        pmodel.mesh.prefix,
        path,
        step,
        ", resharded" if differ else "",
    )
    return step


def _refusal_or_differences(
    path: Path, marker: dict[str, Any], plan: Plan, reshard: bool
) -> list[str]:
    """How the checkpoint's layout differs from this one's (empty: the same).

    Raises:
        ValueError: it was saved for another model, or for another layout and
            ``reshard`` is False.
    """
    if marker.get("fingerprint_kind") != STRUCTURAL:
        log.warning(
            "checkpoint %s identifies its model by a hash this runtime no longer computes "
            "(it was saved before structural fingerprints): it is checked by its parameters' "
            "names and shapes only",
            path,
        )
    elif marker["fingerprint"] != plan.fingerprint:
        raise ValueError(
            f"checkpoint {path} was saved for another model: fingerprint "
            f"{marker['fingerprint']} in the checkpoint, {plan.fingerprint} in the running "
            f"plan ({marker.get('model_file') or 'model file unknown'} then).\n  fix: resume "
            "with the model it was saved from, or start fresh with another checkpoint directory"
        )
    differ = _layout_differences(marker, plan, dist.get_world_size())
    if differ and not reshard:
        raise ValueError(
            f"checkpoint {path} was saved with another layout: {'; '.join(differ)}.\n"
            f"  fix: resume with the plan it was saved with (pp {marker['pp']} × dp "
            f"{marker['dp']}, split points {marker['split_points']}, {marker['world_size']} "
            "processes); or load it into this layout by name with reshard=True (`--reshard`: "
            "weights and optimizer state, not RNG streams); or start fresh with another "
            "checkpoint directory"
        )
    return differ


def _restore(pmodel: ParallelModel, state: dict[str, Any]) -> None:
    """The loaded optimizer state and RNG state into this rank's objects (weights are in place)."""
    if pmodel.optimizer is not None:
        set_optimizer_state_dict(
            rank_module(pmodel.stages), pmodel.optimizer, state["optim"], options=OPTIM_OPTIONS
        )
    if "rng" in state:
        rng = state["rng"][f"rank{pmodel.mesh.rank}"]
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"], pmodel.mesh.device)


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
