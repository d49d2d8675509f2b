"""``python -m runtime model.py --plan plan.yaml``: one worker of a plan (one per rank).

Started by ``torchrun`` or by ``planner run`` (``runtime.launch``), every worker::

    python -m runtime model.py --plan plan.yaml [--steps N] [--checkpoint-dir D]
        [--checkpoint-every K] [--trace trace.json] [--lr LR] [--optimizer adam|adamw|sgd]
        [--step-log DIR]

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
   ``--checkpoint-every`` steps and at the end; with ``--step-log DIR`` every
   rank appends one JSON line per step to ``DIR/rank{R}.jsonl`` (step, loss,
   step time, resident set size: what a soak run watches, ``bench/soak.py``);
5. prints the predicted-vs-measured table and writes the measured trace.

A worker that fails anywhere prints one line, ``[rank R rX sY] failed at
step N: <error>``, records the error for torchrun's summary (which prints
the root cause's traceback once, at the end), tears its process group down
and exits with status 1 at once; torchrun's agent then stops the other
workers (``--monitor-interval``, 0.1 s by default), and a worker blocked on
a peer that never answers gives up after the collective timeout at the
latest (reliability item 18). A worker killed by a signal (SIGKILL: no
exception, no error file) closes its sockets as it dies: its peers fail at
their next receive from it, and torchrun names it and its signal
(``runtime.agent``).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from runtime.launch import _LEARNING_RATES, _add_train_options, _check_options, _cpu_threads

if TYPE_CHECKING:
    from planner.modelfile import Batch, ModelFile
    from planner.plan import Plan

__all__ = ["EXIT_GUARD_S", "main"]

log = logging.getLogger(__name__)

EXIT_GUARD_S = 30.0
"""The longest a worker's teardown may take before it exits anyway (status 1)."""


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
    steplog = _StepLog(ns.step_log, pm.mesh.rank) if ns.step_log else None
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
        if steplog is not None:
            steplog.write(step + 1, loss, secs)
    if steplog is not None:
        steplog.close()
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


class _StepLog:
    """``--step-log DIR``: one JSON line per step to ``DIR/rank{R}.jsonl``, appended.

    A line: ``{"step": 7, "loss": 2.31, "step_s": 0.012, "rss_bytes": 412000256,
    "pid": 1234, "unix_s": ...}``: the step (1-based) just done, after its
    checkpoint if it saved one; the resident set size from ``/proc/self/statm``
    (-1 where there is none). A restarted worker appends to the same file (a
    new ``pid``). Each line is flushed: a worker that dies keeps its lines.
    """

    def __init__(self, directory: str, rank: int) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = open(Path(directory) / f"rank{rank}.jsonl", "a")  # noqa: SIM115 (open for the run)
        self._pid = os.getpid()

    def write(self, step: int, loss: float, step_s: float) -> None:
        line = {
            "step": step,
            "loss": loss,
            "step_s": step_s,
            "rss_bytes": _resident_bytes(),
            "pid": self._pid,
            "unix_s": round(time.time(), 3),
        }
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _resident_bytes() -> int:
    """This process's resident set size now (bytes), or -1 without ``/proc``."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return -1


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
