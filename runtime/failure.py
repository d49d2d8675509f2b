"""How a worker ends: in bounded time, and on a failure with one line that names the cause.

A worker that fails anywhere prints one line, ``[rank R rX sY] failed at step
N: <error>``, records the error for torchrun's summary (which prints the root
cause's traceback once, at the end), tears its process group down and exits
with status 1 at once (:func:`fail`). A worker that succeeds waits for the
others and tears down under a watchdog (:func:`finish`).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
import time
import traceback
from typing import TYPE_CHECKING

import torch.distributed as dist

from planner.plan.files import atomic_write
from planner.plan.text import first_line

if TYPE_CHECKING:
    from runtime.engine import ParallelModel

__all__ = ["EXIT_GUARD_S", "SECONDARY", "Where", "fail", "finish"]

log = logging.getLogger(__name__)

SECONDARY = "plannerSecondary"
"""The error-file key (in ``extraInfo``) marking a failure caused by another rank's."""
EXIT_GUARD_S = 30.0
"""The longest a worker's teardown may take before it exits anyway (status 1)."""


class Where:
    """What the failure line says: who failed, and where (set as the worker goes)."""

    prefix = f"[rank {os.environ.get('RANK', '0')}]"
    where = "while starting"


# [Note: a bounded exit]
# torch's gloo process group can deadlock when destroyed right after a collective: the
# group's worker thread, freeing the finished work, needs the GIL (the work holds tensors
# owned by Python) while the main thread holds the GIL in ~ProcessGroupGloo, joining that
# very thread. Seen here (torch 2.13): rank 1 of a pp 1 × dp 2 run, freeing DDP's group
# right after gathering the measurements, hung for good. So a worker finishes with a
# barrier (waited with the GIL released, so the threads finish their works) and tears
# down under faulthandler's watchdog: a C thread that needs no GIL and, should teardown
# or interpreter shutdown outlast EXIT_GUARD_S, prints every thread's stack and ends the
# process with status 1. The failure path (`fail`, `_teardown`) is guarded the same way.


def finish(pm: ParallelModel) -> None:
    """Every rank done, then the process groups torn down, in bounded time (note above)."""
    if dist.get_world_size() > 1:
        device = pm.mesh.device
        if device.type == "cuda":
            dist.barrier(device_ids=[device.index])
        else:
            dist.barrier()
        time.sleep(0.01)  # the groups' threads drop their finished works
    faulthandler.dump_traceback_later(EXIT_GUARD_S, exit=True)  # armed until the process ends
    pm.close()


def fail(exc: BaseException) -> None:
    """Say what failed (once), record it for torchrun, tear down, exit 1 now (no hang)."""
    root = _root_cause(exc)
    line = f"{Where.prefix} failed {Where.where}: {_first_line(root)}"
    if root is not exc:
        line += f" [raised as {_first_line(exc)}]"
    secondary = _is_comm_error(exc)
    if secondary:
        line += (
            f"\n{Where.prefix} (a communication error: most likely another rank failed "
            "or stopped answering first; its error is the root cause to fix)"
        )
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:  # torchrun prints the root cause's traceback once, in its summary
        _write_error_file(error_file, exc, line if secondary else None)
    else:
        traceback.print_exception(exc, file=sys.stderr)
    print(line, file=sys.stderr, flush=True)
    _teardown()
    sys.stdout.flush()
    os._exit(1)


def _root_cause(exc: BaseException) -> BaseException:
    """The innermost explicit cause (torch's stage wraps a forward's error in its own)."""
    seen = {id(exc)}
    while exc.__cause__ is not None and id(exc.__cause__) not in seen:
        exc = exc.__cause__
        seen.add(id(exc))
    return exc


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {first_line(exc)}".rstrip(": ")


def _is_comm_error(exc: BaseException) -> bool:
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return any(s in text for s in ("Connection closed by peer", "Connection reset", "Timed out"))


def _write_error_file(path: str, exc: BaseException, short: str | None) -> None:
    """torchrun's error-file format (what ``elastic.multiprocessing.errors.record`` writes).

    A communication error (``short`` given) is recorded as one line, one second
    later than now, and marked ``SECONDARY``: torchrun names the earliest
    failure (by whole seconds) as the root cause, and a peer's hang-up is a
    consequence, not a cause. A rank killed by a signal writes no file, and
    torchrun stamps it when it notices, which can be in that next second: the
    agent (``runtime.agent``) reads the mark and puts such failures last. Written
    through a rename: torchrun stops the other ranks (SIGTERM) as soon as one
    fails, and a file cut off mid-write made its agent raise a JSONDecodeError
    of its own instead of printing the summary.
    """
    stamp = int(time.time()) + (1 if short else 0)
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": short or "".join(traceback.format_exception(exc)),
                "timestamp": str(stamp),
                SECONDARY: short is not None,
            },
        }
    }
    try:
        atomic_write(path, json.dumps(data))
    except OSError:
        traceback.print_exception(exc, file=sys.stderr)


def _teardown(timeout_s: float = EXIT_GUARD_S) -> None:
    """Abort (NCCL) or destroy (gloo) the process groups; see [Note: a bounded exit]."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    faulthandler.dump_traceback_later(timeout_s, exit=True)
    try:
        if dist.get_backend() == "nccl":
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()
    except Exception as exc:  # a broken group may refuse; exiting closes its sockets anyway
        log.debug("process group teardown: %s", exc)
