"""``python -m runtime model.py --plan plan.yaml``: one worker of a plan (one per rank).

Started by ``torchrun`` or by ``planner run`` (``runtime.launch``), every worker::

    python -m runtime model.py --plan plan.yaml [--steps N] [--checkpoint-dir D]
        [--checkpoint-every K] [--trace trace.json] [--lr LR] [--optimizer adam|adamw|sgd]
        [--step-log DIR]

(options: :mod:`runtime.options`)

1. loads the plan and the model file (loading runs the file's code: trusted
   input), and builds the model after ``torch.manual_seed(--seed)``: the same
   seed on every rank, so every rank builds the same initial weights (with
   ``--init-from PATH``: its parameters on the meta device, and only this
   rank's stage is then filled from PATH, :mod:`runtime.materialize`);
2. joins the process group and builds its stage (``ParallelModel.from_plan``),
   with a collective timeout of ``--timeout`` seconds;
3. resumes from the newest complete checkpoint in ``--checkpoint-dir``, if any
   (``--steps`` counts from the start of training: a run resumed at step 40
   with ``--steps 100`` trains steps 41 to 100);
4. trains: the batch of step n is its replica's shard of the model file's
   ``dataset()``, or else ``sample_batch(plan.global_batch)`` called with
   torch's RNG seeded to ``seed + n`` (:mod:`runtime.data`: deterministic per
   step, whatever ran before; the training RNG is untouched), and each rank's
   RNG is then seeded per (stage, replica, step) for dropout (``checkpoint.seed_step``);
   rank 0 prints each step's loss and throughput; a checkpoint is saved every
   ``--checkpoint-every`` steps and at the end; with ``--step-log DIR`` every
   rank appends one JSON line per step to ``DIR/rank{R}.jsonl`` (step, loss,
   step time, resident set size: what a soak run watches, ``bench/soak.py``);
5. prints the predicted-vs-measured table and writes the measured trace.

A worker that fails anywhere ends as :mod:`runtime.failure` says: one line
naming the cause, status 1 at once; torchrun's agent then stops the other
workers (``--monitor-interval``, 0.1 s by default), and a worker blocked on
a peer that never answers gives up after the collective timeout at the
latest (reliability item 18). A worker killed by a signal (SIGKILL: no
exception, no error file) closes its sockets as it dies: its peers fail at
their next receive from it, and torchrun names it and its signal
(``runtime.agent``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn

from planner.plan.fields import from_namespace
from planner.plan.files import load_plan
from planner.plan.measured import save_measurement
from planner.plan.modelfile import ModelFile, load_model_file
from planner.plan.schema import Plan, plan_summary
from runtime.checkpoint import latest_complete, load, save, seed_step
from runtime.data import Feed, replica_of
from runtime.engine import ParallelModel
from runtime.failure import Where, fail, finish
from runtime.launch import cpu_threads, pin_cores
from runtime.lifecycle import model_exit, worker_start
from runtime.materialize import meta_parameters
from runtime.measure import Recorder, comparison_table, resident_bytes, write_trace
from runtime.options import DEFAULT_TIMEOUT_S, LEARNING_RATES, RunOptions, add_run_options
from runtime.precision import check_training

__all__ = ["main"]

log = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m runtime``: one worker. Returns 0; on any failure exits the process with 1."""
    parser = argparse.ArgumentParser(
        prog="python -m runtime",
        description="One worker of a plan (start pp × dp of them with torchrun, or use "
        "`planner run`). Loading the model file runs its code.",
    )
    add_run_options(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    ns = parser.parse_args(argv)
    # torch.distributed.pipelining pickles pytree specs through a deprecated
    # alias; the FutureWarning it prints on every rank is torch's, not the user's.
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)
    logging.basicConfig(
        level=logging.INFO if ns.verbose else logging.WARNING,
        format=f"%(levelname)s {Where.prefix} %(name)s: %(message)s",
    )
    try:
        opts = from_namespace(RunOptions, ns)
        lock = worker_start(opts)  # dies with its agent; device check; rank 0's lock
        try:
            return _train(opts)
        finally:
            if lock is not None:
                lock.release()
    except SystemExit as exc:  # nothing of ours exits inside: the model file's code did
        fail(model_exit(exc, ns.model_file))
    except BaseException as exc:  # every failure ends the worker the same way
        fail(exc)
    return 1  # not reached


def _train(opts: RunOptions) -> int:
    plan = load_plan(opts.plan)
    mf = load_model_file(opts.model_file)
    pm, feed = _build(plan, mf, opts)
    # The whole model and the split's traced copies are garbage now, partly in reference
    # cycles (fx graphs and their modules): freed here, not at a collection in some step.
    gc.collect()
    Where.prefix = pm.mesh.prefix
    lead = pm.mesh.rank == 0
    start = 0
    if opts.checkpoint_dir:
        Where.where = "while resuming"
        path = _agree(latest_complete(opts.checkpoint_dir) if lead else None)
        if path is not None:
            start = load(pm, path, reshard=opts.reshard)
            _say(lead, f"resumed from {path} (step {start})")
    _say(lead, f"training {opts.model_file}: {plan_summary(plan)}; steps {start + 1}..{opts.steps}")
    recorder = Recorder(pm, warmup_steps=opts.warmup_steps, first_step=start, memory=opts.memory)
    _loop(pm, feed, plan, opts, start, lead)
    trained = opts.steps > start
    every = opts.checkpoint_every
    if opts.checkpoint_dir and trained and not (every and opts.steps % every == 0):
        Where.where = "saving the final checkpoint"
        _say(lead, f"checkpoint saved: {save(pm, opts.checkpoint_dir, opts.steps)}")
    Where.where = "while measuring"
    result = recorder.gather() if trained else None
    recorder.close()
    if result is not None:
        print(comparison_table(plan, result), flush=True)
        if opts.trace:
            print(f"measured trace written to {write_trace(result, opts.trace)}", flush=True)
        if opts.measurements:
            saved = save_measurement(result, opts.measurements)
            print(f"measurements written to {saved}", flush=True)
    elif lead and not trained:
        print(f"nothing to train: already at step {start} of {opts.steps}", flush=True)
    Where.where = "while finishing"
    finish(pm)
    return 0


def _build(plan: Plan, mf: ModelFile, opts: RunOptions) -> tuple[ParallelModel, Feed]:
    """This rank's stage of the plan, and its replica's feed of batches (runtime.data)."""
    check_training(plan)  # a precision or optimizer this runtime does not run: refused first
    threads = cpu_threads(plan, int(os.environ.get("RANK", "0")))
    if threads and not torch.cuda.is_available():
        if opts.pin_cores:  # [Note: a core of its own] in runtime.launch
            env = {k: int(os.environ.get(k, "1")) for k in ("LOCAL_WORLD_SIZE", "WORLD_SIZE")}
            local = int(os.environ.get("LOCAL_RANK", "0"))
            pin_cores(threads, local, env["LOCAL_WORLD_SIZE"], env["WORLD_SIZE"])
        torch.set_num_threads(threads)  # as the plan measured this device
    torch.manual_seed(opts.seed)  # the same initial weights on every rank
    # What the job is doing until it trains, one line per phase ([Note: launch progress]).
    lead = int(os.environ.get("RANK", "0")) == 0
    _say(lead, f"workers started; building the model ({opts.model_file})")
    with meta_parameters() if opts.init_from else contextlib.nullcontext():
        model = mf.build()  # --init-from: no storage here; the stage's comes from the file
    replica = replica_of(plan, int(os.environ.get("RANK", "0")))
    feed = Feed.of(mf, plan, replica=replica, seed=opts.seed)
    first = feed.batch(0)  # this replica's: traces the stage, then trains step 1
    kind = opts.optimizer or plan.optimizer
    _say(
        lead,
        f"rendezvous of {plan.world_size} workers, then each builds its stage "
        f"(of {plan.pp}: traced and split)"
        if plan.virtual == 1
        else f"rendezvous of {plan.world_size} workers, then each builds its {plan.virtual} "
        f"stages (of {len(plan.stages)}: traced and split)",
    )
    pm = ParallelModel.from_plan(
        model,
        plan,
        loss_fn=mf.loss,
        optimizer=_optimizer(kind, opts.lr),
        sample=(first.args, first.kwargs),
        split=opts.split,
        timeout_s=opts.timeout or DEFAULT_TIMEOUT_S,
        init_from=opts.init_from,
        clip_grad_norm=opts.clip_grad_norm,
        on_nonfinite=opts.on_nonfinite,
    )
    assert pm.mesh.replica == replica, (pm.mesh.replica, replica)
    _say(pm.mesh.rank == 0, feed.describe())
    return pm, feed


def _loop(
    pm: ParallelModel,
    feed: Feed,
    plan: Plan,
    opts: RunOptions,
    start: int,
    lead: bool,
) -> None:
    """Train steps ``start + 1`` … ``opts.steps``, checkpointing and logging as asked."""
    steplog = _StepLog(opts.step_log, pm.mesh.rank) if opts.step_log else None
    every = opts.checkpoint_every
    for step in range(start, opts.steps):
        Where.where = f"at step {step + 1}"
        if step == start:
            _say(lead, f"warming up: step {step + 1} makes the first allocations and lazy set-up")
        batch = feed.batch(step)
        seed_step(pm, step, opts.seed)
        loss = pm.step(batch.inputs(), batch.targets)
        secs = pm.last_step_s or float("nan")
        skipped = "  (update skipped: non-finite)" if pm.last_step_skipped else ""
        _say(
            lead,
            f"step {step + 1}/{opts.steps}  loss {loss:.6f}  {secs * 1e3:.1f} ms  "
            f"{plan.global_batch / secs:.1f} samples/s{skipped}",
        )
        if opts.checkpoint_dir and every and (step + 1) % every == 0:
            _say(lead, f"checkpoint saved: {save(pm, opts.checkpoint_dir, step + 1)}")
        if steplog is not None:
            steplog.write(step + 1, loss, secs)
    if steplog is not None:
        steplog.close()


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
            "rss_bytes": resident_bytes(),
            "pid": self._pid,
            "unix_s": round(time.time(), 3),
        }
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _say(lead: bool, text: str) -> None:
    if lead:
        print(text, flush=True)


def _optimizer(
    kind: str, lr: float | None
) -> Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]:
    rate = LEARNING_RATES[kind] if lr is None else lr
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
