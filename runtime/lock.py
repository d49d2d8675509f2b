"""One run per checkpoint folder: a lock file, ``DIR/LOCK``, held while a run trains.

Two runs on one ``--checkpoint-dir`` would overwrite each other's
checkpoints step by step and both exit 0. So the run holds an exclusive
``flock`` on ``DIR/LOCK`` and writes there who it is (pid, host, start time,
command line); a second run is refused at start, with a message naming the
holder. The kernel releases a ``flock`` when its process dies (SIGKILL
included), so a run that died leaves a lock with no holder: the next run
takes it over and says whose it was. On NFS, Linux maps ``flock`` to the
server's byte-range locks, so the lock holds across machines too.

[Note: who holds the checkpoint lock]
Rank 0's worker takes the lock (:func:`hold`, from ``runtime.worker.main``),
not the launcher: every way of starting a job has exactly one rank 0 —
``planner run``, a plain ``torchrun -m runtime``, and a job over several
machines, each with a launcher of its own, that share the folder. ``planner
run`` also looks before it launches (:func:`check_free`), so that the usual
refusal is one line before any worker starts, rather than a failed rank 0 and
torchrun's summary; the worker's lock still settles a race between two
launchers that looked at the same moment.

Example::

    lock = hold("ckpt", "planner run model.py --plan plan.yaml")   # LockHeld when in use
    ...
    lock.release()
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import IO, Any

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no flock
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_NAME", "LockHeld", "check_free", "hold", "holder_line"]

log = logging.getLogger(__name__)

LOCK_NAME = "LOCK"
"""The lock file's name inside the checkpoint folder."""


class LockHeld(ValueError):
    """Another live run holds the checkpoint folder's lock; the message names it."""


class Lock:
    """A held lock (:func:`hold`); :meth:`release` ends it (so does the process's end)."""

    def __init__(self, path: Path, file: IO[str]) -> None:
        self.path = path
        self._file: IO[str] | None = file

    def release(self) -> None:
        """Empty the file (a clean end: nothing to take over) and unlock. Idempotent."""
        if self._file is None:
            return
        try:
            self._file.truncate(0)
            self._file.flush()
        finally:
            self._file.close()  # closing the descriptor releases the flock
            self._file = None


def holder_line(info: dict[str, Any]) -> str:
    """Who a lock file names, in a few words.

    >>> holder_line({"pid": 7, "host": "n0", "started": "2026-01-02 03:04:05 UTC", "command": "x"})
    'pid 7 on n0, started 2026-01-02 03:04:05 UTC, running `x`'
    """
    return (
        f"pid {info.get('pid', '?')} on {info.get('host', '?')}, started "
        f"{info.get('started', '?')}, running `{info.get('command', '?')}`"
    )


def check_free(directory: str | os.PathLike[str]) -> None:
    """Raise :class:`LockHeld` when a live run holds ``directory``'s lock (nothing is taken).

    Example::

        check_free("ckpt")     # planner run, before launching

    Raises:
        LockHeld: the message names the holder and what to do.
    """
    path = Path(directory) / LOCK_NAME
    if fcntl is None or not path.is_file():
        return
    with open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LockHeld(_held_message(directory, _read(path))) from None
        fcntl.flock(f, fcntl.LOCK_UN)


def hold(directory: str | os.PathLike[str], command: str | None = None) -> Lock:
    """Take ``directory``'s lock for this process, or refuse: one run per checkpoint folder.

    Example::

        lock = hold("ckpt")     # rank 0's worker, before it resumes or saves

    Creates the folder when missing. A lock file left by a run that died (its
    holder gone, the file not emptied) is taken over, with a warning naming
    that run. ``command`` is what the file records as this run's command line
    (default: this process's).

    Raises:
        LockHeld: a live run holds it; the message names the holder (pid, host,
            start time, command) and what to do.
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_NAME
    file = open(path, "a+")  # noqa: SIM115 (held open for the run: the open descriptor is the lock)
    if fcntl is not None:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.close()
            raise LockHeld(_held_message(directory, _read(path))) from None
    file.seek(0)
    before = file.read().strip()
    host = socket.gethostname()
    if before:
        try:
            info = json.loads(before)
        except ValueError:
            info = {}
        info = info if isinstance(info, dict) else {}
        if info.get("parent") == os.getppid() and info.get("host") == host:
            # the same agent's earlier attempt (--max-restarts): this job's own lock
            log.info("%s: taking over the lock of this job's previous attempt", path)
        else:
            log.warning(
                "taking over the lock %s of a run that ended without releasing it (%s); its "
                "last complete checkpoint is where this run resumes",
                path,
                holder_line(info) if info else "unreadable",
            )
    mine = {
        "pid": os.getpid(),
        "parent": os.getppid(),  # the agent: a restarted rank 0 has the same one
        "host": host,
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": command or " ".join([Path(sys.executable).name, *sys.argv]),
    }
    file.seek(0)
    file.truncate(0)
    file.write(json.dumps(mine) + "\n")
    file.flush()
    return Lock(path, file)


def _read(path: Path) -> dict[str, Any]:
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _held_message(directory: str | os.PathLike[str], info: dict[str, Any]) -> str:
    return (
        f"checkpoint folder {directory} is in use by another run ({holder_line(info)}); two "
        "runs on one folder overwrite each other's checkpoints: wait for that run to end, "
        "stop it, or give this one another --checkpoint-dir"
    )
