"""``planner run``: start a plan's workers on this machine (torchrun, loopback rendezvous).

    planner run model.py --plan plan.yaml [--steps N] [--checkpoint-dir D] [--max-restarts R] ...

starts ``plan.world_size`` workers (``python -m runtime``, see
``runtime.worker``) through torchrun's elastic agent (``python -m
runtime.agent``, torchrun with two additions), and exits with their status:

* rendezvous on the loopback address (``--master-addr 127.0.0.1`` and a free
  ``--master-port``): torchrun's c10d rendezvous there, each worker group with
  a store of its own, so that ``--max-restarts`` works; every store and gloo
  socket listens on the loopback address only ([Note: a local run listens on
  loopback only] in ``runtime.rendezvous``). Another ``--master-addr`` is an
  explicit choice (the stores then listen on every interface, as torch's do);
* when a worker fails, torchrun stops the others; ``runtime.agent`` prints the
  failure summary and one line naming the rank that failed first and how (its
  exit status, or the signal that killed it).
* before launching it refuses, in one line each: a busy ``--master-port``, a
  ``--checkpoint-dir`` another run holds (``runtime.lock``), a plan made for
  GPUs on a machine without one (``runtime.checks.check_device``);
* Ctrl-C, SIGTERM or SIGHUP stop the whole job (:func:`_stop`): the agent is
  sent SIGTERM (torchrun stops its workers), SIGKILL after ``STOP_GRACE_S``
  (its workers die with it), and one line names the last complete checkpoint
  and the command that resumes from it. SIGKILL cannot be caught: the agent
  and the workers then die with this process ([Note: a job dies with its
  launcher] in ``runtime.failure``).

The options a worker takes are declared once (:mod:`runtime.options`);
``planner run`` takes the same and hands them on.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import importlib
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from types import FrameType
from typing import Any

from planner.plan.fields import add_options, from_namespace, to_argv
from planner.plan.files import load_plan
from planner.plan.schema import Plan
from runtime.checks import check_device
from runtime.failure import PARENT_ENV
from runtime.lock import check_free
from runtime.options import LOCAL_TIMEOUT_S, LaunchOptions, RunOptions, add_run_options
from runtime.rendezvous import BACKEND, is_loopback

__all__ = [
    "COMMAND_ENV",
    "STOP_GRACE_S",
    "add_run_parser",
    "cmd_run",
    "cpu_threads",
    "pin_cores",
    "torchrun_command",
    "worker_argv",
]

_RUNTIME_ROOT = Path(__file__).resolve().parents[1]  # the folder holding the runtime package
STOP_GRACE_S = 5.0
"""How long a stopped job's agent may take to stop its workers before it is SIGKILLed."""
COMMAND_ENV = "PLANNER_COMMAND"
"""The ``planner run`` command line, handed to the workers (the checkpoint lock names it)."""
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


# --------------------------------------------------------------------------- planner run


def add_run_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``planner run`` to the ``planner`` command's subparsers (``cli.py``)."""
    p = subparsers.add_parser(
        "run",
        help="execute a plan on this machine (torchrun, one process per device)",
        description=(
            "Start the plan's pp × dp workers on this machine with torch's launcher "
            "(python -m torch.distributed.run, rendezvous on the loopback address) and "
            "train MODEL_FILE as the plan says. Loading the model file runs its code; "
            "checkpoints are trusted inputs too."
        ),
    )
    add_run_options(p)
    add_options(p, LaunchOptions)
    p.set_defaults(func=cmd_run)
    return p


def cmd_run(ns: argparse.Namespace) -> int:
    """``planner run``: launch the workers through torchrun; returns their exit status.

    Raises:
        ValueError: a missing plan or model file, or a bad option (before launching).
    """
    run = from_namespace(RunOptions, ns)
    launch = from_namespace(LaunchOptions, ns)
    plan = load_plan(run.plan)
    if not Path(run.model_file).is_file():
        raise ValueError(f"model file {run.model_file} not found (relative to {Path.cwd()})")
    check_device(plan, allow_mismatch=run.allow_device_mismatch)  # rank 0 prints the warnings
    if run.checkpoint_dir:
        check_free(run.checkpoint_dir)  # rank 0 takes the lock ([Note: who holds ...])
    command = _command_line(run, launch)
    if run.timeout is None:
        run = dataclasses.replace(run, timeout=LOCAL_TIMEOUT_S)
    if launch.master_port:
        _check_port(launch.master_addr, launch.master_port)
    port = launch.master_port or _free_port(launch.master_addr)
    verbose = bool(getattr(ns, "verbose", False))  # `planner -v run ...`
    cmd = torchrun_command(run, launch, plan.world_size, port, verbose=verbose)
    env = _worker_env(plan, launch.master_addr)
    env[PARENT_ENV] = str(os.getpid())
    env[COMMAND_ENV] = command
    print(
        f"planner run: {plan.world_size} workers (pp {plan.pp} × dp {plan.dp}) on "
        f"{launch.master_addr}:{port}",
        file=sys.stderr,
        flush=True,
    )
    proc: subprocess.Popen[bytes] | None = None
    with _stop_signals():
        try:
            # a session of its own: a Ctrl-C reaches this process only, which stops the job
            proc = subprocess.Popen(cmd, env=env, start_new_session=True)
            if run.checkpoint_dir:  # seconds of imports: while the job starts, not after a stop
                warm = threading.Thread(
                    target=importlib.import_module, args=("runtime.checkpoint",), daemon=True
                )
                warm.start()
            rc = proc.wait()
        except _Stopped as stop:  # later signals are ignored while the job stops
            return _stop(proc, stop.signum, run.checkpoint_dir, command)
    return rc if rc >= 0 else 128 - rc


class _Stopped(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _stop_signals() -> Any:
    """SIGINT/SIGTERM/SIGHUP raise ``_Stopped`` once; later ones are ignored (the job is
    being stopped); the previous handlers come back at the end."""

    def handler(signum: int, frame: FrameType | None) -> None:
        for sig in _STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        raise _Stopped(signum)

    before = {sig: signal.signal(sig, handler) for sig in _STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in before.items():
            signal.signal(sig, old)


def _stop(
    proc: subprocess.Popen[bytes] | None, signum: int, checkpoint_dir: str | None, command: str
) -> int:
    """Stop the job (the agent stops its workers; SIGKILL after STOP_GRACE_S), say in one
    line where it can resume from, and return 128 + the signal's number."""
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()  # its workers get SIGKILL from the kernel (PR_SET_PDEATHSIG)
            proc.wait()
    name = signal.Signals(signum).name + (" (Ctrl-C)" if signum == signal.SIGINT else "")
    print(
        f"planner run: stopped by {name}; {_resume_note(checkpoint_dir, command)}",
        file=sys.stderr,
        flush=True,
    )
    return 128 + signum


def _resume_note(checkpoint_dir: str | None, command: str) -> str:
    """Where a stopped run resumes from, and the command that does it."""
    from runtime.checkpoint import latest_complete, read_marker

    if not checkpoint_dir:
        return f"no checkpoint to resume from (no --checkpoint-dir); to start over: {command}"
    logging.disable(logging.WARNING)  # a save cut short by the stop is skipped, not news
    try:
        path = latest_complete(checkpoint_dir)
    finally:
        logging.disable(logging.NOTSET)
    if path is None:
        return f"no complete checkpoint in {checkpoint_dir} yet; to start over: {command}"
    step = read_marker(path).get("step", "?")
    return f"the last complete checkpoint is {path} (step {step}); resume with: {command}"


def _command_line(run: RunOptions, launch: LaunchOptions) -> str:
    """This ``planner run`` command line: as typed, when this process is the planner CLI."""
    args = sys.argv[1:]
    if "run" in args and Path(sys.argv[0]).name in ("planner", "__main__.py", "planner.exe"):
        return shlex.join(["planner", *args])
    return shlex.join(["planner", "run", *to_argv(run), *to_argv(launch)])


def _check_port(addr: str, port: int) -> None:
    """Refuse a ``--master-port`` another process listens on, before anything starts."""
    family, kind, proto, _, where = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store binds it
        try:
            s.bind(where)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            raise ValueError(
                f"--master-port {port} is already in use on {addr} (another run, or another "
                f"program, listens there: `ss -ltnp 'sport = :{port}'` names it); pass another "
                "port, or --master-port 0 for a free one"
            ) from None


def torchrun_command(
    run: RunOptions, launch: LaunchOptions, world_size: int, port: int, *, verbose: bool = False
) -> list[str]:
    """The agent's command: ``python -m runtime.agent`` (torchrun's options) ``-m runtime ...``.

    Example::

        torchrun_command(run, launch, 4, 29500)   # [..., "--rdzv-endpoint", "127.0.0.1:29500", ...]

    One node; the rendezvous endpoint and the workers' own address are
    ``launch.master_addr`` (127.0.0.1 unless given).
    """
    return [
        sys.executable,
        "-m",
        "runtime.agent",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(world_size),
        # [Note: rendezvous for restarts] c10d rendezvous with a store per attempt: the static
        # one (--master-addr/--master-port) keeps the agent's store across --max-restarts, and
        # restarted workers then read the failed attempt's gloo addresses and cannot connect.
        "--rdzv-backend",
        BACKEND,  # torchrun's c10d, its store on loopback only (runtime.rendezvous)
        "--rdzv-endpoint",
        f"{launch.master_addr}:{port}",
        "--rdzv-id",
        uuid.uuid4().hex,
        "--local-addr",
        launch.master_addr,
        "--max-restarts",
        str(launch.max_restarts),
        "-m",
        "runtime",
        *worker_argv(run, verbose=verbose),
    ]


def worker_argv(run: RunOptions, *, verbose: bool = False) -> list[str]:
    """The worker's arguments (model file and options): ``run`` as a command line."""
    return to_argv(run) + (["--verbose"] if verbose else [])


def _worker_env(plan: Plan, addr: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # [Note: rendezvous for restarts]
    root = str(_RUNTIME_ROOT)  # `-m runtime` finds this package from any working directory
    paths = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = root + (os.pathsep + paths if paths else "")
    env.setdefault("OMP_NUM_THREADS", str(cpu_threads(plan, 0) or 1))  # as the plan measured
    if is_loopback(addr):  # gloo/NCCL on loopback too, not a NIC
        lo = _loopback_interface()
        if lo:
            env.setdefault("GLOO_SOCKET_IFNAME", lo)
            env.setdefault("NCCL_SOCKET_IFNAME", lo)
    return env


def _loopback_interface() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in names if n in ("lo", "lo0")), None)


def _free_port(addr: str) -> int:
    family, kind, proto, _, where = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as s:
        s.bind(where)
        return int(s.getsockname()[1])


def cpu_threads(plan: Plan, rank: int) -> int | None:
    """The torch threads the plan gave ``rank``'s CPU device (None: a GPU, or not recorded)."""
    group = plan.cluster.device(rank)
    if group is None or group.type != "cpu":
        return None
    return group.threads or None


def pin_cores(
    threads: int, local_rank: int, local_world: int, world: int | None = None
) -> list[int] | None:
    """Keep this CPU worker (and the threads it starts) to a run of cores of its own.

    [Note: a core of its own] The local processes of a CPU plan share the
    machine's cores; left to the OS scheduler, two of them sometimes share one
    core while another idles, and a step takes that launch's luck. Each worker of
    ``local_world`` on this machine, ``threads`` torch threads each, keeps to
    cores ``local_rank · threads`` … ``+ threads − 1`` of those it may use, when
    they are enough for all (else nothing is pinned: they would share anyway).
    Only a job of several workers, all on this machine, is pinned (a worker alone
    has nothing to be kept apart from; the agents of a job over several machines
    started on one would each count from core 0). Two jobs on one machine would
    both count from core 0 too: give them ``--no-pin-cores``. Call it before
    torch starts its thread pool (threads inherit the affinity).
    Measured on 2 cores, launches alternating with ``--no-pin-cores`` (step,
    median of the launches): BERT from transformers at pp 2, m 4, five each:
    20.7–27.3 ms unpinned (median 23.3), 18.2–21.5 pinned (21.0); three each,
    the bundled MLP 133.3 → 129.1 ms, ResNet 89.6 → 79.5, MobileNetV3 from
    torchvision 119.1 → 105.9. With more processes than cores nothing is pinned
    (BERT at pp 2 × dp 2, 4 processes on 2 cores, pinned two to a core by hand:
    46.9–59.1 ms against 51.7–62.1, within the launches' spread).

    ``world``: the job's workers on every machine (default ``local_world``).
    Returns the cores kept to, or None where nothing was pinned (not Linux, one
    worker, workers on other machines, or too few cores).
    """
    alone = local_world < 2 or (world or local_world) != local_world
    if alone or not hasattr(os, "sched_setaffinity") or threads < 1:
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if local_world * threads > len(allowed) or not 0 <= local_rank < local_world:
        return None
    cores = allowed[local_rank * threads : (local_rank + 1) * threads]
    os.sched_setaffinity(0, cores)
    return cores
