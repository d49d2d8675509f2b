"""How a worker ends: in bounded time, and on a failure with one line that names the cause.

A worker that fails anywhere prints one line, ``[rank R rX sY] failed at step
N: <error>``, records the error for torchrun's summary (which prints the root
cause's traceback once, at the end; for an expected refusal, its whole message
and no traceback), tears its process group down and exits
with status 1 at once (:func:`fail`). A worker that succeeds waits for the
others and tears down under a watchdog (:func:`finish`). A worker, and
torchrun's agent, whose parent dies goes with it (:func:`die_with_parent`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING

import torch.distributed as dist

from planner.plan.files import atomic_write
from planner.plan.text import first_line

if TYPE_CHECKING:
    from runtime.engine import ParallelModel

__all__ = [
    "EXIT_GUARD_S",
    "PARENT_ENV",
    "SECONDARY",
    "ModelFileExit",
    "Where",
    "die_with_parent",
    "fail",
    "finish",
]

log = logging.getLogger(__name__)

SECONDARY = "plannerSecondary"
"""The error-file key (in ``extraInfo``) marking a failure caused by another rank's."""
EXIT_GUARD_S = 30.0
"""The longest a worker's teardown may take before it exits anyway (status 1)."""


PARENT_ENV = "PLANNER_PARENT_PID"
"""The pid a launched process must die with: set by ``planner run`` for its agent, and by
the agent (``runtime.agent``) for its workers, before they start."""
_WATCH_S = 0.5  # how often the portable watchdog looks at os.getppid()


class Where:
    """What the failure line says: who failed, and where (set as the worker goes)."""

    prefix = f"[rank {os.environ.get('RANK', '0')}]"
    where = "while starting"
    checkpoint_dir: str | None = None  # named when a save runs out of space


class ModelFileExit(RuntimeError):
    """The model file's code called ``sys.exit`` (or raised ``SystemExit``) inside the run."""


# [Note: a job dies with its launcher]
# torchrun starts every worker in a session of its own (start_new_session), and
# `planner run` its agent, so no signal sent to the launcher, nor a Ctrl-C at the
# terminal, reaches them: a launcher that is SIGTERMed or SIGKILLed used to leave its
# agent and every worker training, unattended. So each launched process asks the
# kernel for a signal when its parent dies (Linux `prctl(PR_SET_PDEATHSIG)`): the agent
# SIGTERM (torchrun's own shutdown: it stops its workers), a worker SIGKILL (a worker
# whose agent is gone has nobody to report to). Where there is no prctl, a daemon
# thread polls os.getppid() and does the same. The parent's pid comes in PARENT_ENV,
# set before the fork: a parent that died before the child's prctl is caught too.


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have this process get ``sig`` when its parent dies (see the note above).

    Example::

        die_with_parent(signal.SIGTERM)   # the agent: torchrun then stops its workers

    The parent is ``PLANNER_PARENT_PID`` when set (it must still be our parent:
    else it is already gone, and ``sig`` is sent now), else ``os.getppid()``.
    """
    expected = int(os.environ.get(PARENT_ENV) or os.getppid())
    if not _prctl_pdeathsig(sig):
        threading.Thread(target=_watch_parent, args=(expected, sig), daemon=True).start()
    if os.getppid() != expected:  # the parent died before the request above
        os.kill(os.getpid(), sig)


def _prctl_pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        return int(libc.prctl(pr_set_pdeathsig, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(expected: int, sig: int) -> None:
    while os.getppid() == expected:
        time.sleep(_WATCH_S)
    os.kill(os.getpid(), sig)


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
    full = isinstance(root, OSError) and root.errno == errno.ENOSPC
    what = _disk_full(root) if isinstance(root, OSError) and full else _first_line(root)
    line = f"{Where.prefix} failed {Where.where}: {what}"
    if root is not exc and _checkpoint_error(exc) is None:  # DCP's wrapper says nothing more
        line += f" [raised as {_first_line(exc)}]"
    secondary = _is_comm_error(exc)
    if secondary:
        line += (
            f"\n{Where.prefix} (a communication error: most likely another rank failed "
            "or stopped answering first; its error is the root cause to fix)"
        )
    # An expected refusal (a crafted checkpoint, a plan for another machine, a model file
    # that exits) says what, why and the fix itself: its whole message, never a traceback.
    refusal = f"{type(root).__name__}: {root}" if _is_refusal(root) else None
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:  # torchrun prints the root cause's traceback once, in its summary
        _write_error_file(error_file, exc, line if secondary else None, callstack=refusal)
    elif refusal is not None:
        line = f"{Where.prefix} failed {Where.where}: {refusal}"
    else:
        traceback.print_exception(exc, file=sys.stderr)
    print(line, file=sys.stderr, flush=True)
    _teardown()
    sys.stdout.flush()
    os._exit(1)


def _is_refusal(exc: BaseException) -> bool:
    """A failure the runtime raises on purpose with the fix in its message: the user's input
    refused (``ValueError``: ``CheckpointRefused``, ``PlanMismatch``, ``LockHeld``, a model file
    breaking its contract) or the model file's ``sys.exit`` (``ModelFileExit``)."""
    return isinstance(exc, (ValueError, ModelFileExit))


def _root_cause(exc: BaseException) -> BaseException:
    """The innermost explicit cause (torch's stage wraps a forward's error in its own; DCP
    gathers every rank's error of a save into one ``CheckpointException``)."""
    seen = {id(exc)}
    while id(exc) in seen:
        inner = exc.__cause__ or _checkpoint_error(exc)
        if inner is None or id(inner) in seen:
            break
        exc = inner
        seen.add(id(exc))
    return exc


def _checkpoint_error(exc: BaseException) -> BaseException | None:
    """This rank's error (else the lowest rank's) inside DCP's ``CheckpointException``,
    whose own text is only ``CheckpointException ranks:dict_keys([0, 1])``."""
    failures = getattr(exc, "failures", None)
    if type(exc).__name__ != "CheckpointException" or not isinstance(failures, dict):
        return None
    rank = int(os.environ.get("RANK", "0"))
    for key in [rank, *sorted(failures)]:
        found = failures.get(key)
        if isinstance(found, BaseException):
            return found
        if isinstance(found, tuple) and found and isinstance(found[0], BaseException):
            return found[0]  # (exception, traceback) in some torch versions
    return None


def _disk_full(exc: OSError) -> str:
    """ENOSPC, cause first: the folder, the space left there, and the fix."""
    folder = Where.checkpoint_dir or (os.path.dirname(exc.filename) if exc.filename else None)
    where = f" in {folder}" if folder else ""
    free = ""
    if folder:
        try:
            stat = os.statvfs(folder)
            free = f" ({stat.f_bavail * stat.f_frsize / 2**20:.1f} MiB free there now)"
        except OSError:
            pass
    return (
        f"No space left on device{where}{free} while writing {exc.filename or 'a file'}; "
        "free space there or give another --checkpoint-dir (incomplete checkpoints are "
        "skipped on resume)"
    )


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {first_line(exc)}".rstrip(": ")


def _is_comm_error(exc: BaseException) -> bool:
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return any(s in text for s in ("Connection closed by peer", "Connection reset", "Timed out"))


def _write_error_file(
    path: str, exc: BaseException, short: str | None, *, callstack: str | None = None
) -> None:
    """torchrun's error-file format (what ``elastic.multiprocessing.errors.record`` writes).

    ``callstack``: what torchrun's summary shows as the "traceback" of an expected
    refusal: its whole message, instead of Python's traceback.

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
                "py_callstack": short or callstack or "".join(traceback.format_exception(exc)),
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
