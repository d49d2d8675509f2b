"""A worker's start and end around training: what ``runtime.worker.main`` does first and last.

:func:`worker_start`, before anything else: die with the agent ([Note: a job
dies with its launcher] in ``runtime.failure``), check the plan's device
types against this machine (``runtime.checks.check_device``), and on rank 0
take the checkpoint folder's lock ([Note: who holds the checkpoint lock] in
``runtime.lock``). :func:`model_exit`: a ``SystemExit`` out of the model
file's code, turned into a failure that says so (where, with which code),
instead of a worker that vanished with a status nobody explains.
"""

from __future__ import annotations

import logging
import os
import signal

from planner.plan.files import load_plan
from planner.plan.modelimport import exit_site
from runtime.checks import check_device
from runtime.failure import ModelFileExit, Where, die_with_parent
from runtime.launch import COMMAND_ENV
from runtime.lock import Lock, hold
from runtime.options import RunOptions

__all__ = ["model_exit", "worker_start"]

log = logging.getLogger(__name__)


def worker_start(opts: RunOptions) -> Lock | None:
    """Everything a worker does before it builds its stage; the lock it holds (rank 0).

    Example::

        lock = worker_start(opts)
        try:
            train(opts)
        finally:
            if lock is not None:
                lock.release()

    Raises:
        runtime.checks.PlanMismatch: a GPU plan on a machine without a GPU (every rank).
        runtime.lock.LockHeld: another run holds ``--checkpoint-dir`` (rank 0).
    """
    die_with_parent(signal.SIGKILL)
    lead = os.environ.get("RANK", "0") == "0"
    note = check_device(load_plan(opts.plan), allow_mismatch=opts.allow_device_mismatch)
    if note and lead:
        log.warning("%s", note)
    Where.checkpoint_dir = opts.checkpoint_dir
    if opts.checkpoint_dir and lead:
        return hold(opts.checkpoint_dir, os.environ.get(COMMAND_ENV))
    return None


def model_exit(exc: SystemExit, model_file: str | None) -> ModelFileExit:
    """The failure to report for ``exc``, a ``SystemExit`` raised while training.

    >>> try:
    ...     raise SystemExit(3)
    ... except SystemExit as e:
    ...     print(model_exit(e, "model.py"))  # doctest: +ELLIPSIS
    sys.exit(3) was called in the run (at ...), ...

    Names the model file's frame that called it (file:line in function) when
    the traceback has one.
    """
    call, where, mine = exit_site(exc, model_file)
    if mine:
        return ModelFileExit(
            f"the model file {model_file} called {call} at {where}; a model file must return "
            "or raise, not exit: the worker cannot finish its step or tell its peers (raise an "
            "exception to stop the run)"
        )
    return ModelFileExit(
        f"{call} was called in the run (at {where}), not by the runtime; code the model "
        "file calls must raise an exception instead, so that the run can say why it stopped"
    )
