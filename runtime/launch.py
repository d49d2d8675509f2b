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

The options a worker takes are declared once (:mod:`runtime.options`);
``planner run`` takes the same and hands them on.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from planner.plan.fields import add_options, from_namespace, to_argv
from planner.plan.files import load_plan
from planner.plan.schema import Plan
from runtime.options import LOCAL_TIMEOUT_S, LaunchOptions, RunOptions, add_run_options
from runtime.rendezvous import BACKEND, is_loopback

__all__ = ["add_run_parser", "cmd_run", "cpu_threads", "torchrun_command", "worker_argv"]

_RUNTIME_ROOT = Path(__file__).resolve().parents[1]  # the folder holding the runtime package


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
    if run.timeout is None:
        run = dataclasses.replace(run, timeout=LOCAL_TIMEOUT_S)
    port = launch.master_port or _free_port(launch.master_addr)
    verbose = bool(getattr(ns, "verbose", False))  # `planner -v run ...`
    cmd = torchrun_command(run, launch, plan.world_size, port, verbose=verbose)
    env = _worker_env(plan, launch.master_addr)
    print(
        f"planner run: {plan.world_size} workers (pp {plan.pp} × dp {plan.dp}) on "
        f"{launch.master_addr}:{port}",
        file=sys.stderr,
        flush=True,
    )
    proc = subprocess.Popen(cmd, env=env)
    try:
        rc = proc.wait()
    except KeyboardInterrupt:  # torchrun stops its workers on SIGINT/SIGTERM
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return 130
    return rc if rc >= 0 else 128 - rc


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
