"""``python -m runtime.agent [torchrun options] -m runtime ...``: torchrun, for ``planner run``.

It takes torchrun's own arguments (``python -m torch.distributed.run --help``)
and runs torchrun's elastic agent in this process, with these additions:

* the rendezvous backend ``planner-c10d``: torchrun's c10d, whose store
  listens on the loopback address only when the endpoint is one
  (``runtime.rendezvous``, [Note: a local run listens on loopback only]);
* when the workers fail, torchrun's failure summary (every failed rank, and
  the root cause: the earliest failure that is not a peer's hang-up, with its
  traceback: ``root_first``) is printed without
  the agent's own Python traceback, followed by one line saying which rank
  failed first and how — its exit status, or the signal that killed it (a rank
  killed by a signal leaves no error of its own: this line is the only
  place that names it). Exit status 1;
* it dies with its parent (``planner run``), and its workers with it
  ([Note: a job dies with its launcher] in ``runtime.failure``);
* stopped by a signal (SIGTERM, SIGINT: ``planner run`` forwards its own),
  torchrun stops the workers and the agent exits 128 + the signal's number
  quietly: no traceback and no log lines, the launcher says what happened.

Restarts (``--max-restarts``) and the stopping of the other workers when one
fails are torchrun's: its agent checks the workers every ``--monitor-interval``
seconds (0.1 by default) and, when one has failed, stops the others (SIGTERM,
then SIGKILL after 30 s) and restarts them all or gives up.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any

__all__ = ["main", "root_first", "verdict"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run torchrun's agent with ``argv`` (its command line); 0 when every worker succeeded."""
    import torch.distributed.elastic.multiprocessing.api as elastic_api
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from runtime.failure import PARENT_ENV, die_with_parent
    from runtime.rendezvous import register_backend

    die_with_parent(signal.SIGTERM)  # torchrun's shutdown: the workers are stopped first
    os.environ[PARENT_ENV] = str(os.getpid())  # the workers die with this process
    elastic_api._terminate_process_handler = _quiet_stop  # torchrun installs it at each start
    register_backend()
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    # [Note: launch progress] Between the launch line and the first step, a job spends
    # seconds on imports (here, then in each worker), the model's build, the rendezvous
    # and the stages' tracing: one line each says which (the workers' from rank 0).
    started = f"starting {args.nproc_per_node} worker(s) on this machine"
    print(f"planner run: {started}", file=sys.stderr, flush=True)
    try:
        run(args)
    except SignalException as exc:  # stopped on purpose: the launcher says so, in one line
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        root_first(exc)
        print(exc.format_msg(), file=sys.stderr)
        print(verdict(exc), file=sys.stderr, flush=True)
        return 1
    return 0


def _quiet_stop(signum: int, frame: FrameType | None) -> None:
    """torchrun's termination handler, silenced: raise its ``SignalException`` (its agent
    then stops the workers) with every log line of the shutdown turned off."""
    from torch.distributed.elastic.multiprocessing import SignalException

    logging.disable(logging.CRITICAL)
    sigval = signal.Signals(signum)
    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)


def root_first(exc: Any) -> None:
    """Stamp the failures a rank recorded as caused by another's (``runtime.failure``'s
    ``SECONDARY`` mark: a peer's hang-up) one second after every other failure, so that
    torchrun's root cause (the earliest stamp) is a rank's own error or death. Its stamps
    are whole seconds, and a rank killed by a signal is stamped when torchrun notices
    it, which can be after its peer's hang-up was recorded."""
    from runtime.failure import SECONDARY

    def secondary(failure: Any) -> bool:
        message = failure.error_file_data.get("message")
        return isinstance(message, dict) and message.get("extraInfo", {}).get(SECONDARY) is True

    own = [f.timestamp for f in exc.failures.values() if not secondary(f)]
    if own:
        for f in exc.failures.values():
            if secondary(f):
                f.timestamp = max(f.timestamp, max(own) + 1)


def verdict(exc: Any) -> str:
    """One line on the root cause of torchrun's ``ChildFailedError``: which rank, and how.

    >>> from torch.distributed.elastic.multiprocessing import errors
    >>> f = errors.ProcessFailure(local_rank=1, pid=42, exitcode=-9, error_file="")
    >>> print(verdict(errors.ChildFailedError("runtime", {1: f})))  # doctest: +ELLIPSIS
    planner run: rank 1 (local rank 1, pid 42) was killed by signal 9 (SIGKILL), not by ...
    """
    rank, failure = exc.get_first_failure()
    who = f"rank {rank} (local rank {failure.local_rank}, pid {failure.pid})"
    code = int(failure.exitcode)
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        hint = (
            "If nobody killed it on purpose: the kernel's out-of-memory killer sends SIGKILL "
            "(see `dmesg`); lower the memory a rank needs"
            if -code == signal.SIGKILL
            else "Look for what sent it"
        )
        return (
            f"planner run: {who} was killed by signal {-code} ({name}), not by an error of "
            f"its own; the other ranks were stopped. {hint}"
        )
    others = sorted(r for r in exc.failures if r != rank)
    also = f"; rank(s) {', '.join(map(str, others))} failed after it" if others else ""
    return (
        f"planner run: {who} failed first, with exit status {code}{also}; its error is the "
        "Root Cause above"
    )


if __name__ == "__main__":
    sys.exit(main())
