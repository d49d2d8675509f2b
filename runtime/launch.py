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

The options a worker takes are defined here once (``_add_train_options``);
``planner run`` takes the same and hands them on.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from planner.plan import Plan

__all__ = ["LOCAL_TIMEOUT_S", "add_run_parser", "cmd_run", "torchrun_command", "worker_argv"]

LOCAL_TIMEOUT_S = 120.0
"""``planner run``'s collective timeout (seconds): on one machine a peer that
has not answered in two minutes is gone. ``python -m runtime`` defaults to
``runtime.mesh.DEFAULT_TIMEOUT_S`` (multi-node jobs start more slowly)."""

_LEARNING_RATES = {"adam": 1e-3, "adamw": 1e-3, "sgd": 1e-2}
_RUNTIME_ROOT = Path(__file__).resolve().parents[1]  # the folder holding the runtime package


# --------------------------------------------------------------------------- options


def _add_train_options(p: argparse.ArgumentParser) -> None:
    """The options a worker takes; ``planner run`` takes the same and passes them on."""
    p.add_argument("model_file", help="a model.py defining build_model() and sample_batch(n)")
    p.add_argument("--plan", required=True, help="the plan file (`planner plan ... --out`)")
    p.add_argument(
        "--steps",
        type=int,
        default=10,
        help="train until this many optimizer steps are done, counted from the start "
        "(a resumed run continues to it; default 10)",
    )
    p.add_argument("--checkpoint-dir", default=None, help="save to and resume from this folder")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="save every K steps (default 0: only at the end); needs --checkpoint-dir",
    )
    p.add_argument(
        "--reshard",
        action="store_true",
        help="resume from a checkpoint of another layout of the same model (by name)",
    )
    p.add_argument("--trace", default=None, help="write the measured Chrome/Perfetto trace here")
    p.add_argument(
        "--optimizer",
        choices=sorted(_LEARNING_RATES),
        default=None,
        help="default: the plan's optimizer (sgd means SGD with momentum 0.9)",
    )
    p.add_argument("--lr", type=float, default=None, help="default: 1e-3 (adam/adamw), 1e-2 (sgd)")
    p.add_argument("--seed", type=int, default=0, help="model initialization and data seed")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds a collective waits for a peer before failing (default: 300 for "
        f"python -m runtime, {LOCAL_TIMEOUT_S:.0f} for planner run)",
    )
    p.add_argument(
        "--split", choices=["auto", "pipeline", "fx"], default="auto", help="how to split"
    )
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=1,
        help="steps left out of the measured figures (default 1)",
    )
    p.add_argument(
        "--step-log",
        default=None,
        metavar="DIR",
        help="every rank appends one JSON line per step to DIR/rank{R}.jsonl: step, loss, "
        "step seconds, resident set size (bytes)",
    )


_PASSED = (  # (dest, flag) of the options `planner run` hands to every worker
    ("plan", "--plan"),
    ("steps", "--steps"),
    ("checkpoint_dir", "--checkpoint-dir"),
    ("checkpoint_every", "--checkpoint-every"),
    ("trace", "--trace"),
    ("optimizer", "--optimizer"),
    ("lr", "--lr"),
    ("seed", "--seed"),
    ("timeout", "--timeout"),
    ("split", "--split"),
    ("warmup_steps", "--warmup-steps"),
    ("step_log", "--step-log"),
)


def _check_options(ns: argparse.Namespace) -> None:
    if ns.steps < 0:
        raise ValueError(f"--steps must be ≥ 0, got {ns.steps}")
    if ns.checkpoint_every < 0:
        raise ValueError(f"--checkpoint-every must be ≥ 0, got {ns.checkpoint_every}")
    if ns.checkpoint_every and not ns.checkpoint_dir:
        raise ValueError("--checkpoint-every needs --checkpoint-dir (where to save)")
    if ns.timeout is not None and ns.timeout <= 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {ns.timeout}")
    if ns.warmup_steps < 0:
        raise ValueError(f"--warmup-steps must be ≥ 0, got {ns.warmup_steps}")


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
    _add_train_options(p)
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart all workers this many times after a failure (torchrun's option); "
        "with --checkpoint-dir they resume from the last complete checkpoint",
    )
    p.add_argument(
        "--master-addr",
        default="127.0.0.1",
        help="rendezvous address, also the workers' own (default 127.0.0.1: loopback)",
    )
    p.add_argument(
        "--master-port", type=int, default=0, help="rendezvous port (default: a free one)"
    )
    p.set_defaults(func=cmd_run)
    return p


def cmd_run(ns: argparse.Namespace) -> int:
    """``planner run``: launch the workers through torchrun; returns their exit status.

    Raises:
        ValueError: a missing plan or model file, or a bad option (before launching).
    """
    from planner.plan import load_plan

    _check_options(ns)
    if ns.max_restarts < 0:
        raise ValueError(f"--max-restarts must be ≥ 0, got {ns.max_restarts}")
    plan = load_plan(ns.plan)
    if not Path(ns.model_file).is_file():
        raise ValueError(f"model file {ns.model_file} not found (relative to {Path.cwd()})")
    if ns.timeout is None:
        ns.timeout = LOCAL_TIMEOUT_S
    port = ns.master_port or _free_port(ns.master_addr)
    cmd = torchrun_command(ns, plan.world_size, port)
    env = _worker_env(plan, ns.master_addr)
    print(
        f"planner run: {plan.world_size} workers (pp {plan.pp} × dp {plan.dp}) on "
        f"{ns.master_addr}:{port}",
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


def torchrun_command(ns: argparse.Namespace, world_size: int, port: int) -> list[str]:
    """The agent's command: ``python -m runtime.agent`` (torchrun's options) ``-m runtime ...``.

    Example::

        torchrun_command(ns, 4, 29500)   # [..., "--rdzv-endpoint", "127.0.0.1:29500", ...]

    One node; the rendezvous endpoint and the workers' own address are
    ``ns.master_addr`` (127.0.0.1 unless given).
    """
    from runtime.rendezvous import BACKEND

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
        f"{ns.master_addr}:{port}",
        "--rdzv-id",
        uuid.uuid4().hex,
        "--local-addr",
        ns.master_addr,
        "--max-restarts",
        str(ns.max_restarts),
        "-m",
        "runtime",
        *worker_argv(ns),
    ]


def worker_argv(ns: argparse.Namespace) -> list[str]:
    """The worker's arguments (model file and options) from ``planner run``'s namespace."""
    argv = [str(ns.model_file)]
    for dest, flag in _PASSED:
        value = getattr(ns, dest, None)
        if value is not None:
            argv += [flag, str(value)]
    if ns.reshard:
        argv.append("--reshard")
    if getattr(ns, "verbose", False):  # `planner -v run ...`
        argv.append("--verbose")
    return argv


def _worker_env(plan: Plan, addr: str) -> dict[str, str]:
    from runtime.rendezvous import is_loopback

    env = dict(os.environ)
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # [Note: rendezvous for restarts]
    root = str(_RUNTIME_ROOT)  # `-m runtime` finds this package from any working directory
    paths = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = root + (os.pathsep + paths if paths else "")
    env.setdefault("OMP_NUM_THREADS", str(_cpu_threads(plan, 0) or 1))  # as the plan measured
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


def _cpu_threads(plan: Plan, rank: int) -> int | None:
    """The torch threads the plan gave ``rank``'s CPU device (None: a GPU, or not recorded)."""
    devices: list[dict[str, Any]] = []
    for node in plan.cluster.get("nodes") or ():
        for group in node.get("devices") or ():
            devices += [group] * int(group.get("count", 1))
    if rank >= len(devices) or devices[rank].get("type") != "cpu":
        return None
    return int(devices[rank].get("threads") or 0) or None
