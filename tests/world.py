"""Run a function in N processes that form a torch.distributed world (gloo on CPU), safely.

Example::

    results = run_world(my_worker, 2, args=("plan.yaml",), timeout_s=60)

Each process gets the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR=127.0.0.1, MASTER_PORT a free port) and OMP_NUM_THREADS=1, calls
``fn(*args)``, and hands back its return value. Nothing can hang the test
run: the whole world is killed at ``timeout_s``, and when one rank fails the
others get ``grace_s`` to finish or fail before they are killed. Any failure
raises ``WorldFailed`` whose message holds every failing rank's traceback.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp


class WorldFailed(AssertionError):
    """A rank raised, died, or the world ran past its timeout."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple[Any, ...] = (),
    timeout_s: float = 120.0,
    grace_s: float = 15.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ranks 0..world_size-1; return their results in rank order.

    ``fn`` must be importable by name (a module-level function) since the
    processes are spawned, not forked.
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="dist-") as tmp, _env({"OMP_NUM_THREADS": "1"}):
        out = Path(tmp)
        procs = [
            ctx.Process(
                target=_child,
                args=(fn, args, rank, world_size, port, str(out), dict(env or {})),
                name=f"rank{rank}",
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        problem = _wait(procs, timeout_s, grace_s)
        errors = []
        for rank, p in enumerate(procs):
            err = out / f"rank{rank}.err"
            if err.exists():
                errors.append(f"--- rank {rank} raised:\n{err.read_text()}")
            elif p.exitcode not in (0, None):
                errors.append(f"--- rank {rank} exited with code {p.exitcode}")
        if problem or errors:
            raise WorldFailed("\n".join([problem or "a rank failed", *errors]))
        return [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(world_size)]


def _wait(procs: list[Any], timeout_s: float, grace_s: float) -> str | None:
    """Join all; kill everyone at the deadline, or ``grace_s`` after the first failure."""
    start = time.monotonic()
    deadline = start + timeout_s
    problem = None
    while any(p.is_alive() for p in procs):
        failed = [p.name for p in procs if p.exitcode not in (0, None)]
        if failed and problem is None:
            problem = f"{', '.join(failed)} failed; the others were given {grace_s:.0f} s"
            deadline = min(deadline, time.monotonic() + grace_s)
        if time.monotonic() > deadline:
            alive = [p.name for p in procs if p.is_alive()]
            problem = problem or f"timed out after {timeout_s:.0f} s"
            problem += f"; killed {', '.join(alive)}"
            for p in procs:
                if p.is_alive():
                    p.kill()
            break
        time.sleep(0.05)
    for p in procs:
        p.join(timeout=5)
    return problem


def _child(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    rank: int,
    world_size: int,
    port: int,
    out: str,
    env: dict[str, str],
) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        **env,
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        result = fn(*args)
        Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    except BaseException:
        Path(out, f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)  # skip atexit/process-group teardown that could wait on dead peers
    if dist.is_initialized():
        dist.destroy_process_group()
    # The result is on disk: leave without the interpreter's teardown, where gloo's
    # threads were once torn down under a live process group's destructor (SIGABRT,
    # "terminate called without an active exception", once in a CI run) and turned a
    # passed rank into a failed one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
