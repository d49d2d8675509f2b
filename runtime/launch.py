"""Run a plan: ``python -m runtime`` (one worker, under torchrun); ``planner run`` (local launch).

Every worker (one per rank, started by ``torchrun`` or by ``planner run``)::

    python -m runtime model.py --plan plan.yaml [--steps N] [--checkpoint-dir D]
        [--checkpoint-every K] [--trace trace.json] [--lr LR] [--optimizer adam|adamw|sgd]

1. loads the plan and the model file (loading runs the file's code: trusted
   input), and builds the model after ``torch.manual_seed(--seed)``: the same
   seed on every rank, so every rank builds the same initial weights;
2. joins the process group and builds its stage (``ParallelModel.from_plan``),
   with a collective timeout of ``--timeout`` seconds;
3. resumes from the newest complete checkpoint in ``--checkpoint-dir``, if any
   (``--steps`` counts from the start of training: a run resumed at step 40
   with ``--steps 100`` trains steps 41 to 100);
4. trains: the batch of step n is ``sample_batch(plan.global_batch)`` called
   with torch's RNG seeded to ``seed + n`` (deterministic per step, whatever
   ran before; the training RNG is untouched), and each rank's RNG is then
   seeded per (stage, replica, step) for dropout (``checkpoint.seed_step``);
   rank 0 prints each step's loss and throughput; a checkpoint is saved every
   ``--checkpoint-every`` steps and at the end;
5. prints the predicted-vs-measured table and writes the measured trace.

A worker that fails anywhere prints one line, ``[rank R rX sY] failed at
step N: <error>``, records the error for torchrun's summary (which prints
the root cause's traceback once, at the end), tears its process group down
and exits with status 1 at once; torchrun's agent then stops the other
workers (``--monitor-interval``, 0.1 s by default), and a worker blocked on
a peer that never answers gives up after the collective timeout at the
latest (reliability item 18).

``planner run`` starts ``plan.world_size`` such workers on this machine through
``python -m torch.distributed.run`` (torchrun), rendezvous on the loopback
address (``--master-addr 127.0.0.1`` and a free ``--master-port``: torchrun's
c10d rendezvous there, each worker group with a store of its own, so that
``--max-restarts`` works), and exits with their status.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
import uuid
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from planner.modelfile import Batch, ModelFile
    from planner.plan import Plan

__all__ = ["EXIT_GUARD_S", "LOCAL_TIMEOUT_S", "add_run_parser", "cmd_run", "main"]

log = logging.getLogger(__name__)

LOCAL_TIMEOUT_S = 120.0
"""``planner run``'s collective timeout (seconds): on one machine a peer that
has not answered in two minutes is gone. ``python -m runtime`` defaults to
``runtime.mesh.DEFAULT_TIMEOUT_S`` (multi-node jobs start more slowly)."""

EXIT_GUARD_S = 30.0
"""The longest a worker's teardown may take before it exits anyway (status 1)."""

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
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(plan.world_size),
        # [Note: rendezvous for restarts] c10d rendezvous with a store per attempt: the static
        # one (--master-addr/--master-port) keeps the agent's store across --max-restarts, and
        # restarted workers then read the failed attempt's gloo addresses and cannot connect.
        "--rdzv-backend",
        "c10d",
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
    env = dict(os.environ)
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # [Note: rendezvous for restarts]
    root = str(_RUNTIME_ROOT)  # `-m runtime` finds this package from any working directory
    paths = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = root + (os.pathsep + paths if paths else "")
    env.setdefault("OMP_NUM_THREADS", str(_cpu_threads(plan, 0) or 1))  # as the plan measured
    if addr in ("127.0.0.1", "localhost", "::1"):  # gloo/NCCL on loopback too, not a NIC
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
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr if addr != "localhost" else "127.0.0.1", 0))
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


# --------------------------------------------------------------------------- the worker


class _Where:
    """What the failure line says: who failed, and where."""

    prefix = f"[rank {os.environ.get('RANK', '0')}]"
    where = "while starting"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m runtime``: one worker. Returns 0; on any failure exits the process with 1."""
    parser = argparse.ArgumentParser(
        prog="python -m runtime",
        description="One worker of a plan (start pp × dp of them with torchrun, or use "
        "`planner run`). Loading the model file runs its code.",
    )
    _add_train_options(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    ns = parser.parse_args(argv)
    # torch.distributed.pipelining pickles pytree specs through a deprecated
    # alias; the FutureWarning it prints on every rank is torch's, not the user's.
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)
    logging.basicConfig(
        level=logging.INFO if ns.verbose else logging.WARNING,
        format=f"%(levelname)s {_Where.prefix} %(name)s: %(message)s",
    )
    try:
        _check_options(ns)
        return _train(ns)
    except SystemExit:
        raise
    except BaseException as exc:  # every failure ends the worker the same way
        _fail(exc)
    return 1  # not reached


def _train(ns: argparse.Namespace) -> int:
    import torch

    from planner.modelfile import load_model_file
    from planner.plan import load_plan, plan_summary
    from runtime.checkpoint import latest_complete, load, save, seed_step
    from runtime.engine import ParallelModel
    from runtime.measure import Recorder, comparison_table, write_trace
    from runtime.mesh import DEFAULT_TIMEOUT_S

    plan = load_plan(ns.plan)
    mf = load_model_file(ns.model_file)
    rank = int(os.environ.get("RANK", "0"))
    threads = _cpu_threads(plan, rank)
    if threads and not torch.cuda.is_available():
        torch.set_num_threads(threads)  # as the plan measured this device
    torch.manual_seed(ns.seed)  # the same initial weights on every rank
    model = mf.build()
    first = _batch(mf, plan, 0, ns.seed)
    kind = ns.optimizer or (plan.optimizer if plan.optimizer in _LEARNING_RATES else "adam")
    pm = ParallelModel.from_plan(
        model,
        plan,
        loss_fn=mf.loss,
        optimizer=_optimizer(kind, ns.lr),
        sample=(first.args, first.kwargs),
        split=ns.split,
        timeout_s=ns.timeout or DEFAULT_TIMEOUT_S,
    )
    _Where.prefix = pm.mesh.prefix
    lead = pm.mesh.rank == 0
    start = 0
    if ns.checkpoint_dir:
        _Where.where = "while resuming"
        path = _agree(latest_complete(ns.checkpoint_dir) if lead else None)
        if path is not None:
            start = load(pm, path, reshard=ns.reshard)
            _say(lead, f"resumed from {path} (step {start})")
    _say(lead, f"training {ns.model_file}: {plan_summary(plan)}; steps {start + 1}..{ns.steps}")
    recorder = Recorder(pm, warmup_steps=ns.warmup_steps, first_step=start)
    every = ns.checkpoint_every
    for step in range(start, ns.steps):
        _Where.where = f"at step {step + 1}"
        batch = first if step == 0 else _batch(mf, plan, step, ns.seed)
        seed_step(pm, step, ns.seed)
        loss = pm.step(_inputs(batch), batch.targets)
        secs = pm.last_step_s or float("nan")
        _say(
            lead,
            f"step {step + 1}/{ns.steps}  loss {loss:.6f}  {secs * 1e3:.1f} ms  "
            f"{plan.global_batch / secs:.1f} samples/s",
        )
        if ns.checkpoint_dir and every and (step + 1) % every == 0:
            _say(lead, f"checkpoint saved: {save(pm, ns.checkpoint_dir, step + 1)}")
    trained = ns.steps > start
    if ns.checkpoint_dir and trained and not (every and ns.steps % every == 0):
        _Where.where = "saving the final checkpoint"
        _say(lead, f"checkpoint saved: {save(pm, ns.checkpoint_dir, ns.steps)}")
    _Where.where = "while measuring"
    result = recorder.gather() if trained else None
    recorder.close()
    if result is not None:
        print(comparison_table(plan, result), flush=True)
        if ns.trace:
            print(f"measured trace written to {write_trace(result, ns.trace)}", flush=True)
    elif lead and not trained:
        print(f"nothing to train: already at step {start} of {ns.steps}", flush=True)
    _Where.where = "while finishing"
    _finish(pm)
    return 0


# [Note: a bounded exit]
# torch's gloo process group can deadlock when destroyed right after a collective: the
# group's worker thread, freeing the finished work, needs the GIL (the work holds tensors
# owned by Python) while the main thread holds the GIL in ~ProcessGroupGloo, joining that
# very thread. Seen here (torch 2.13): rank 1 of a pp 1 × dp 2 run, freeing DDP's group
# right after gathering the measurements, hung for good. So a worker finishes with a
# barrier (waited with the GIL released, so the threads finish their works) and tears
# down under faulthandler's watchdog: a C thread that needs no GIL and, should teardown
# or interpreter shutdown outlast EXIT_GUARD_S, prints every thread's stack and ends the
# process with status 1. The failure path (`_teardown`) is guarded the same way.


def _finish(pm: Any) -> None:
    """Every rank done, then the process groups torn down, in bounded time (note above)."""
    import torch.distributed as dist

    if dist.get_world_size() > 1:
        device = pm.mesh.device
        if device.type == "cuda":
            dist.barrier(device_ids=[device.index])
        else:
            dist.barrier()
        time.sleep(0.01)  # the groups' threads drop their finished works
    faulthandler.dump_traceback_later(EXIT_GUARD_S, exit=True)  # armed until the process ends
    pm.close()


def _say(lead: bool, text: str) -> None:
    if lead:
        print(text, flush=True)


def _batch(mf: ModelFile, plan: Plan, step: int, seed: int) -> Batch:
    """Step ``step``'s global batch: ``sample_batch`` with torch's RNG at ``seed + step``."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + step)
        return mf.sample(plan.global_batch)


def _inputs(batch: Batch) -> Any:
    if batch.args and batch.kwargs:
        raise ValueError(
            "sample_batch returned inputs with both positional and keyword arguments; "
            "the runtime passes one kind: return a tuple or a dict"
        )
    return dict(batch.kwargs) if batch.kwargs else batch.args


def _optimizer(kind: str, lr: float | None) -> Any:
    import torch

    rate = _LEARNING_RATES[kind] if lr is None else lr
    if kind == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=rate, momentum=0.9)
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    return lambda ps: cls(ps, lr=rate)


def _agree(path: Path | None) -> Path | None:
    """Rank 0's choice of checkpoint, on every rank (they must resume from the same one)."""
    import torch.distributed as dist

    box: list[Any] = [str(path) if path is not None else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return Path(box[0]) if box[0] is not None else None


# --------------------------------------------------------------------------- failure


def _fail(exc: BaseException) -> None:
    """Say what failed (once), record it for torchrun, tear down, exit 1 now (no hang)."""
    root = _root_cause(exc)
    line = f"{_Where.prefix} failed {_Where.where}: {_first_line(root)}"
    if root is not exc:
        line += f" [raised as {_first_line(exc)}]"
    secondary = _is_comm_error(exc)
    if secondary:
        line += (
            f"\n{_Where.prefix} (a communication error: most likely another rank failed "
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
    lines = [x.strip() for x in str(exc).splitlines() if x.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def _is_comm_error(exc: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return any(s in text for s in ("Connection closed by peer", "Connection reset", "Timed out"))


def _write_error_file(path: str, exc: BaseException, short: str | None) -> None:
    """torchrun's error-file format (what ``elastic.multiprocessing.errors.record`` writes).

    A communication error (``short`` given) is recorded as one line, one second
    later than now: torchrun names the earliest failure (by whole seconds) as
    the root cause, and a peer's hang-up is a consequence, not a cause.
    """
    stamp = int(time.time()) + (1 if short else 0)
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": short or "".join(traceback.format_exception(exc)),
                "timestamp": str(stamp),
            },
        }
    }
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        traceback.print_exception(exc, file=sys.stderr)


def _teardown(timeout_s: float = EXIT_GUARD_S) -> None:
    """Abort (NCCL) or destroy (gloo) the process groups; see [Note: a bounded exit]."""
    import torch.distributed as dist

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
