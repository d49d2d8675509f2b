"""What ``bench.bench_runtime`` runs inside its spawned gloo worlds (CPU), one function per study.

Every public ``*_worker`` runs on every rank of a world started by :func:`spawn`
and returns plain data (rank 0's is what the bench reports). Timing protocol,
everywhere: warm-up first; then repeats in which the implementations under
comparison alternate (order reversed every other repeat), each timed between
two barriers, so a step counts until the slowest rank is done and both sides
see the same machine load. Medians of the repeats are reported by the bench.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import resource
import socket
import statistics
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from bench._common import knobs

# --------------------------------------------------------------------------- worlds


def cpu_busy_s() -> float:
    """Seconds of CPU time the whole machine has spent busy since boot (/proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    r = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(x.ru_utime + x.ru_stime for x in r)


def wait_quiet(max_wait_s: float, busy_below: float = 0.15) -> dict[str, float]:
    """Wait (at most ``max_wait_s``) for a 1-s window in which other processes use under
    ``busy_below`` of the machine: other engineers share it."""
    start = time.monotonic()
    share = 1.0
    while True:
        b0, o0, t0 = cpu_busy_s(), _own_cpu_s(), time.monotonic()
        time.sleep(1.0)
        wall = time.monotonic() - t0
        share = max(0.0, (cpu_busy_s() - b0) - (_own_cpu_s() - o0)) / (wall * (os.cpu_count() or 1))
        if share < busy_below or time.monotonic() - start > max_wait_s:
            return {"waited_s": time.monotonic() - start, "foreign_share_before": share}


def spawn(
    fn: Callable[..., Any],
    world: int,
    *,
    args: tuple[Any, ...] = (),
    omp_threads: str | None = "1",
    env: dict[str, str] | None = None,
    timeout_s: float = 300.0,
) -> tuple[list[Any], dict[str, float]]:
    """Run ``fn(*args)`` on ranks 0..world-1 (spawned, gloo env).

    Returns the ranks' results in rank order, and the machine's load meanwhile:
    ``foreign_share``, the share of all cores other processes kept busy (the
    machine is shared; high values mean noisy figures).

    ``omp_threads``: OMP_NUM_THREADS in the workers (None: unset, torch's default).
    ``env``: more environment for the workers, set before they start (glibc reads
    its MALLOC_* variables at process start).
    The whole world is killed at ``timeout_s``; a failing rank raises here with
    its traceback.
    """
    b0, o0, w0 = cpu_busy_s(), _own_cpu_s(), time.monotonic()
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="bench-rt-") as tmp:
        procs = [
            ctx.Process(target=_child, args=(fn, args, r, world, port, tmp, omp_threads))
            for r in range(world)
        ]
        with knobs(env or {}):
            for p in procs:
                p.start()
        deadline = time.monotonic() + timeout_s
        while any(p.is_alive() for p in procs):
            failed = any(p.exitcode not in (0, None) for p in procs)
            if time.monotonic() > deadline or failed:
                time.sleep(2.0 if failed else 0.0)
                for p in procs:
                    if p.is_alive():
                        p.kill()
                break
            time.sleep(0.05)
        for p in procs:
            p.join(timeout=5)
        errs = [Path(tmp, f"{r}.err") for r in range(world)]
        msgs = [f"rank {r}:\n{e.read_text()}" for r, e in enumerate(errs) if e.exists()]
        if msgs or any(p.exitcode != 0 for p in procs):
            codes = [p.exitcode for p in procs]
            raise RuntimeError(f"{fn.__name__} failed (exit codes {codes})\n" + "\n".join(msgs))
        results = [pickle.loads(Path(tmp, f"{r}.pkl").read_bytes()) for r in range(world)]
    wall = time.monotonic() - w0
    foreign = max(0.0, (cpu_busy_s() - b0) - (_own_cpu_s() - o0))
    load = {"wall_s": wall, "foreign_share": foreign / (wall * (os.cpu_count() or 1))}
    return results, load


def _child(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    rank: int,
    world: int,
    port: int,
    out: str,
    omp_threads: str | None,
) -> None:
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    os.environ.update(env)
    if omp_threads is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = omp_threads
    # torch's own deprecation noise from deep-copying pipeline() graphs, once per copy.
    warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
    try:
        result = fn(*args)
        Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))
    except BaseException:
        Path(out, f"{rank}.err").write_text(traceback.format_exc())
        os._exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()


def _init() -> int:
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_rank()


def _agree(n: int) -> int:
    """The same count on every rank (rank 0's), so loops stay in step."""
    t = torch.tensor([n])
    dist.broadcast(t, 0)
    return int(t.item())


def _timed(fn: Callable[[], Any]) -> float:
    """Seconds from a barrier to the barrier after ``fn`` (the slowest rank's finish)."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


QUIET_SHARE = 0.10
"""A round counts as quiet when other processes used under this share of all cores."""


def alternate(
    impls: dict[str, Callable[[], Any]],
    *,
    repeats: int,
    warmup: int = 2,
    max_rounds: int | None = None,
    budget_s: float | None = None,
    clocks: dict[str, Clock] | None = None,
) -> dict[str, Any]:
    """Warm each implementation up, then time them in rounds, alternating (ABBA...).

    The machine is shared: each round records the share of all cores that other
    processes kept busy meanwhile (``foreign``, from /proc/stat less both ranks'
    CPU time). Rounds go on until ``repeats`` of them were quiet (see
    :data:`QUIET_SHARE`), or ``max_rounds`` (default 3 × repeats) were run, or
    ``budget_s`` (default: $BENCH_RT_BUDGET_S, else 60) has passed with at least
    ``repeats`` rounds. Returns seconds per
    implementation per round, ``foreign`` per round (rank 0's reading), and with
    ``clocks`` (implementation → Clock wrapping its parts) each part's seconds
    per round on this rank.
    """
    for fn in impls.values():
        for _ in range(warmup):
            _timed(fn)
    names = list(impls)
    out: dict[str, list[float]] = {n: [] for n in names}
    parts: dict[str, list[dict[str, float]]] = {n: [] for n in clocks or {}}
    foreign: list[float] = []
    max_rounds = max_rounds or 3 * repeats
    if budget_s is None:
        budget_s = float(os.environ.get("BENCH_RT_BUDGET_S", "60"))
    start = time.perf_counter()
    while True:
        k = len(foreign)
        c0, b0, w0 = time.process_time(), cpu_busy_s(), time.perf_counter()
        for n in names if k % 2 == 0 else names[::-1]:
            before = dict(clocks[n].total) if clocks and n in clocks else None
            out[n].append(_timed(impls[n]))
            if before is not None:
                after = clocks[n].total  # type: ignore[index]
                parts[n].append({p: v - before.get(p, 0.0) for p, v in after.items()})
        own = torch.tensor([time.process_time() - c0], dtype=torch.float64)
        dist.all_reduce(own)  # both ranks' CPU seconds in this round
        wall = time.perf_counter() - w0
        busy = cpu_busy_s() - b0
        foreign.append(max(0.0, busy - float(own.item())) / (wall * (os.cpu_count() or 1)))
        quiet = sum(f < QUIET_SHARE for f in foreign)
        over = time.perf_counter() - start > budget_s and len(foreign) >= repeats
        if _agree(int(quiet >= repeats or len(foreign) >= max_rounds or over)):
            break
    return {"times": out, "foreign": foreign, "parts": parts}


# --------------------------------------------------------------------------- models


class Stack(nn.Module):
    """``n`` × (Linear(width) → ReLU): uniform, compute-heavy, split at ``layers.k``."""

    def __init__(self, n: int = 8, width: int = 1024) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(n)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def build(spec: dict[str, Any]) -> nn.Module:
    """The bench's models by spec (the same seed, so every rank holds the same weights)."""
    torch.manual_seed(0)
    if spec["kind"] == "stack":
        return Stack(spec["n"], spec["width"])
    from planner.plan.modelfile import load_model_file

    gpt = load_model_file(Path(__file__).resolve().parents[1] / "examples" / "gpt.py").module
    return gpt.build_model(**spec["kw"])


def batch(spec: dict[str, Any], size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + seed)
    if spec["kind"] == "stack":
        w = spec["width"]
        return torch.randn(size, w, generator=gen), torch.randn(size, w, generator=gen)
    kw = spec["kw"]
    tokens = torch.randint(0, kw["vocab_size"], (size, kw["seq_len"] + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn_for(spec: dict[str, Any]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return F.mse_loss if spec["kind"] == "stack" else _lm_loss


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


# --------------------------------------------------------------------------- p2p


def p2p_worker(sizes: list[int], budget_s: float) -> dict[str, Any]:
    """One-way time of a gloo send/recv of ``n`` bytes (ping-pong RTT / 2), the same via
    ``batch_isend_irecv`` (the path torch.distributed.pipelining takes), and an all-reduce
    of ``n`` bytes (what DDP and the tied-weight sync do)."""
    torch.set_num_threads(1)
    rank = _init()
    peer = 1 - rank
    res: dict[str, Any] = {"send_recv": {}, "batch_isend_irecv": {}, "barrier_cpu": None}

    def pingpong(t: torch.Tensor, batched: bool) -> None:
        def send() -> None:
            if batched:
                for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, peer)]):
                    w.wait()
            else:
                dist.send(t, peer)

        def recv() -> None:
            if batched:
                for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, peer)]):
                    w.wait()
            else:
                dist.recv(t, peer)

        if rank == 0:
            send()
            recv()
        else:
            recv()
            send()

    def op(kind: str, t: torch.Tensor) -> float:
        """Seconds of one transfer: a ping-pong / 2, or one all-reduce."""
        t0 = time.perf_counter()
        if kind == "all_reduce":
            dist.all_reduce(t)
            return time.perf_counter() - t0
        pingpong(t, kind == "batch_isend_irecv")
        return (time.perf_counter() - t0) / 2

    for n in sizes:
        t = torch.zeros(max(1, n // 4), dtype=torch.float32)
        for kind in ("send_recv", "batch_isend_irecv", "all_reduce"):
            if kind == "batch_isend_irecv" and n > 4 << 20:
                continue
            t0 = time.perf_counter()
            for _ in range(3):
                op(kind, t)
            count = _agree(min(200, max(5, int(budget_s * 3 / (time.perf_counter() - t0)))))
            times: list[float] = []
            for _ in range(count):
                dist.barrier()
                times.append(op(kind, t))
            res.setdefault(kind, {})[n] = times
    # Does a rank blocked in a gloo barrier burn CPU? (It must not, for the
    # "one process alone" baselines, where the other rank waits in one.)
    c0, w0 = time.process_time(), time.perf_counter()
    if rank == 0:
        time.sleep(1.0)
    dist.barrier()
    res["barrier_cpu"] = (time.process_time() - c0) / (time.perf_counter() - w0)
    return res


# --------------------------------------------------------------------------- co-run


def corun_worker(repeats: int) -> dict[str, Any]:
    """Is the machine itself the limit? Kernels, each on rank 0 alone and on both ranks at
    once (1 torch thread each): compute-bound in L2 (192² matmuls), the pipeline stage's
    working set (4 × Linear(1024) weights, 16 MB: L3), weights streamed from memory
    (16 × 4 MB = 64 MB, beyond the 32 MB L3); and the cost of one minor page fault
    (touching fresh pages: what glibc's returned-then-reused memory costs)."""
    torch.set_num_threads(1)
    rank = _init()
    gen = torch.Generator().manual_seed(rank)
    small = torch.randn(192, 192, generator=gen)
    x = torch.randn(64, 1024, generator=gen)
    l3 = [torch.randn(1024, 1024, generator=gen) for _ in range(4)]
    dram = [torch.randn(1024, 1024, generator=gen) for _ in range(16)]

    def l2() -> None:
        a = small
        for _ in range(400):
            a = torch.mm(a, small).div_(100.0)

    def stream(ws: list[torch.Tensor], n: int) -> Callable[[], None]:
        def run() -> None:
            for k in range(n):
                torch.mm(x, ws[k % len(ws)])

        return run

    def faults() -> None:  # 16 MB of fresh pages: one minor fault (and a zeroed page) each
        buf = mmap.mmap(-1, 16 << 20)
        for off in range(0, 16 << 20, 4096):
            buf[off] = 1
        buf.close()

    kernels = {
        "L2 matmul": l2,
        "L3 weights": stream(l3, 48),
        "DRAM weights": stream(dram, 48),
        "page faults": faults,
    }
    flops = {"L2 matmul": 400 * 2 * 192**3, "L3 weights": 48 * 2 * 64 * 1024**2}
    flops["DRAM weights"] = flops["L3 weights"]
    flops["page faults"] = 0
    impls: dict[str, Callable[[], None]] = {}
    for name, fn in kernels.items():
        impls[f"{name} alone"] = _threads(1, fn, only_rank0=True)
        impls[f"{name} both"] = _threads(1, fn)
    return {
        "rank": rank,
        "flops": flops,
        "pages": (16 << 20) // 4096,
        "times": alternate(impls, repeats=repeats),
    }


# --------------------------------------------------------------------------- instrumentation


class Clock:
    """Accumulated seconds of wrapped methods (instance attributes shadow the class's)."""

    def __init__(self) -> None:
        self.total: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._undo: list[Callable[[], None]] = []

    def wrap(self, obj: Any, name: str, key: str) -> None:
        orig = getattr(obj, name)
        had = name in vars(obj)

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                self.total[key] = self.total.get(key, 0.0) + time.perf_counter() - t0
                self.calls[key] = self.calls.get(key, 0) + 1

        setattr(obj, name, timed)
        self._undo.append(lambda: setattr(obj, name, orig) if had else delattr(obj, name))

    def restore(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def _wrap_stage(clock: Clock, stage: Any, schedule: Any) -> None:
    clock.wrap(schedule, "step", "schedule.step")
    clock.wrap(stage, "forward_one_chunk", "  forward actions")
    clock.wrap(stage, "backward_one_chunk", "  backward actions")
    if hasattr(stage, "perform_reduce_grad"):
        clock.wrap(stage, "perform_reduce_grad", "  grad scale (÷m)")


# --------------------------------------------------------------------------- two implementations


def ours(model: nn.Module, plan: Any, spec: dict[str, Any], x: torch.Tensor) -> Any:
    from runtime.engine import ParallelModel

    return ParallelModel.from_plan(
        model, plan, loss_fn=loss_fn_for(spec), optimizer=_sgd, sample=((x,), {})
    )


def _sgd(params: Any) -> torch.optim.Optimizer:
    # The planner's "sgd" is SGD with momentum (one state tensor per parameter).
    return torch.optim.SGD(params, lr=1e-4, momentum=0.9)


class Handwritten:
    """The script a user would write without us: pipeline() + build_stage + ScheduleGPipe
    (pp > 1), or DDP with no_sync gradient accumulation over m micro-batches (pp = 1)."""

    def __init__(self, model: nn.Module, plan: Any, spec: dict[str, Any], x: torch.Tensor):
        from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline
        from torch.nn.parallel import DistributedDataParallel

        self.rank, self.m, self.pp = dist.get_rank(), plan.micro_batches, plan.pp
        self.loss_fn = loss_fn_for(spec)
        b = plan.micro_batch_size
        if plan.pp > 1:
            assert plan.dp == 1, "the hand-written pipeline is pp-only"
            spec_ = {fqn: SplitPoint.BEGINNING for fqn in plan.split_points}
            pipe = pipeline(model, mb_args=(x[:b],), split_spec=spec_)
            self.stage = pipe.build_stage(self.rank, torch.device("cpu"))
            self.schedule = ScheduleGPipe(
                self.stage, self.m, loss_fn=self.loss_fn, scale_grads=True
            )
            self.opt = _sgd(self.stage.submod.parameters())
        else:
            assert plan.pp == 1
            self.ddp = DistributedDataParallel(model)
            self.opt = _sgd(self.ddp.parameters())
            self.shard = plan.global_batch // plan.dp

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.opt.zero_grad(set_to_none=True)
        if self.pp > 1:
            if self.rank == 0:
                self.schedule.step(x, return_outputs=False)
            else:
                self.schedule.step(target=y, losses=[], return_outputs=False)
        else:
            lo = self.rank * self.shard
            xs, ys = x[lo : lo + self.shard].chunk(self.m), y[lo : lo + self.shard].chunk(self.m)
            for i in range(self.m):
                ctx = self.ddp.no_sync() if i < self.m - 1 else contextlib.nullcontext()
                with ctx:
                    self.loss_fn(self.ddp(xs[i]), ys[i]).div(self.m).backward()
        self.opt.step()


# --------------------------------------------------------------------------- 1. overhead


def overhead_worker(cases: list[dict[str, Any]], repeats: int, profile_steps: int) -> dict:
    """Ours vs the hand-written script, per case; then each one's time by part."""
    torch.set_num_threads(1)
    rank = _init()
    return {"rank": rank, "cases": {c["name"]: _overhead(c, repeats, profile_steps) for c in cases}}


def _overhead(case: dict[str, Any], repeats: int, profile_steps: int) -> dict[str, Any]:
    spec, plan = case["spec"], case["plan"]
    x, y = batch(spec, plan.global_batch)
    pm = ours(build(spec), plan, spec, x)
    hw = Handwritten(build(spec), plan, spec, x)
    impls = {
        "ours": lambda: pm.step(x, y),
        "torch": lambda: hw.step(x, y),
        "ours, fx codegen": codegen(pm, lambda: pm.step(x, y)),
    }
    if pm.tied.mine:
        # Ours with the tied-gradient all-reduce skipped: what that all-reduce costs a step.
        impls["ours, tied sync skipped"] = lambda: _without(pm.tied, "sync_grads", pm.step, x, y)
    if plan.pp == 1:
        # Our DDP-wrapped stage module (the exported graph) in the hand-written loop: splits
        # ours − torch into the schedule's share and the module's.
        impls["hand-written loop on our stage"] = lambda: _ddp_loop(pm, plan, spec, x, y)
    times = alternate(impls, repeats=repeats)
    # By part: a separate pass (the wrappers stay out of the comparison), also alternating.
    c = Clock()
    c.wrap(pm, "_shard", "_shard (batch checks, dp cut)")
    c.wrap(pm.stage.module, "zero_grad", "zero_grad")
    _wrap_stage(c, pm.stage.pipeline_stage, pm.schedule)
    c.wrap(pm.tied, "sync_grads", "tied.sync_grads")
    if pm.optimizer is not None:
        c.wrap(pm.optimizer, "step", "optimizer.step")
    c.wrap(pm, "_reduce_loss", "_reduce_loss (loss broadcast)")
    h = Clock()
    if plan.pp > 1:
        _wrap_stage(h, hw.stage, hw.schedule)
    h.wrap(hw.opt, "step", "optimizer.step")
    parts = alternate(
        {"ours": lambda: pm.step(x, y), "torch": lambda: hw.step(x, y)},
        repeats=profile_steps,
        warmup=0,
        clocks={"ours": c, "torch": h},
    )
    c.restore()
    h.restore()
    # The tied all-reduce alone (no waiting on the other stage's backward in it).
    tied_ms = None
    if pm.tied.mine:
        tied_ms = med([_timed(pm.tied.sync_grads) for _ in range(profile_steps)]) * 1e3
    return {
        "times": times,
        "parts": parts,
        "tied_groups": len(pm.tied.mine),
        "tied_alone_ms": tied_ms,
        "split_method": pm.stage.method,
    }


def codegen(pm: Any, fn: Callable[[], Any]) -> Callable[[], None]:
    """``fn`` with the stage's torch.export submodules running their generated code instead
    of ``torch.fx.Interpreter`` (the flag torch itself flips under dynamo)."""
    mods = [m for m in pm.stage.module.modules() if hasattr(m, "_run_with_interpreter")]

    def run() -> None:
        for m in mods:
            m._run_with_interpreter = False
        try:
            fn()
        finally:
            for m in mods:
                m._run_with_interpreter = True

    return run


def _without(obj: Any, name: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with ``obj.name`` replaced by a no-op."""
    setattr(obj, name, lambda *a, **k: None)
    try:
        return fn(*args)
    finally:
        delattr(obj, name)


def _ddp_loop(pm: Any, plan: Any, spec: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> None:
    """The hand-written no_sync accumulation loop, run on our DDP-wrapped stage module."""
    ddp, m, loss_fn = pm.stage.wrapped, plan.micro_batches, loss_fn_for(spec)
    shard = plan.global_batch // plan.dp
    lo = pm.mesh.replica * shard
    xs, ys = x[lo : lo + shard].chunk(m), y[lo : lo + shard].chunk(m)
    pm.stage.module.zero_grad(set_to_none=True)
    for i in range(m):
        ctx = ddp.no_sync() if i < m - 1 else contextlib.nullcontext()
        with ctx:
            out = ddp(xs[i])
            out = out[0] if isinstance(out, tuple) else out
            loss_fn(out, ys[i]).div(m).backward()
    pm.optimizer.step()


# --------------------------------------------------------------------------- 2. efficiency


def _stage_compute(pm: Any, spec: dict[str, Any], plan: Any) -> Callable[[], None]:
    """This rank's stage alone: m forwards and backwards of its module, no communication."""
    b, m, w = plan.micro_batch_size, plan.micro_batches, spec["width"]
    mod = pm.stage.module
    gen = torch.Generator().manual_seed(7)
    first = pm.mesh.is_first_stage
    ins = [torch.randn(b, w, generator=gen).requires_grad_(not first) for _ in range(m)]
    grads = [torch.randn(b, w, generator=gen) for _ in range(m)]

    def run() -> None:
        outs = []
        for i in range(m):
            out = mod(ins[i])
            outs.append(out[0] if isinstance(out, tuple) else out)
        for i in range(m):
            outs[i].backward(grads[i])

    return run


def _threads(n: int, fn: Callable[[], Any], only_rank0: bool = False) -> Callable[[], None]:
    """``fn`` with ``n`` torch threads (back to 1 after); optionally on rank 0 only."""

    def run() -> None:
        if only_rank0 and dist.get_rank() != 0:
            return
        torch.set_num_threads(n)
        try:
            fn()
        finally:
            torch.set_num_threads(1)

    return run


def _count_faults(fn: Callable[[], Any], into: list[int]) -> Callable[[], None]:
    """``fn``, recording this process's minor page faults per call (0 calls: not appended)."""

    def run() -> None:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        fn()
        into.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

    return run


def efficiency_worker(
    spec: dict[str, Any], plans: list[Any], threads_too: list[bool], repeats: int
) -> dict:
    """Per plan (one m each): the pipelined step (1 torch thread per process; also 2 where
    ``threads_too``), the whole model in one process (1 and 2 threads; the other rank idle
    in a barrier), and one stage's compute with no communication, alone and with the
    other stage computing."""
    default = torch.get_num_threads()  # before anyone sets it: what the worker got
    env = os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    _init()
    single = build(spec)
    opt = _sgd(single.parameters())
    rows = [
        _efficiency(spec, plan, single, opt, repeats, two)
        for plan, two in zip(plans, threads_too, strict=True)
    ]
    return {"default_threads": default, "omp_env": env, "rows": rows}


def _efficiency(
    spec: dict[str, Any], plan: Any, single: nn.Module, opt: Any, repeats: int, two: bool
) -> dict[str, Any]:
    x, y = batch(spec, plan.global_batch)
    pm = ours(build(spec), plan, spec, x)
    compute = _stage_compute(pm, spec, plan)
    loss_fn = loss_fn_for(spec)

    def single_step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(single(x), y).backward()
        opt.step()

    impls = {
        "pipelined 1 thread/proc": _threads(1, lambda: pm.step(x, y)),
        "one process 1 thread": _threads(1, single_step, only_rank0=True),
        "one process 2 threads": _threads(2, single_step, only_rank0=True),
        "stage compute alone": _threads(1, compute, only_rank0=True),
        "stage compute, both stages": _threads(1, compute),
    }
    if two:  # 2 processes × 2 threads on 2 cores: oversubscribed (and slow: costs time)
        impls["pipelined 2 threads/proc"] = _threads(2, lambda: pm.step(x, y))
    faults: dict[str, list[int]] = {}
    times = alternate(
        {k: _count_faults(fn, faults.setdefault(k, [])) for k, fn in impls.items()},
        repeats=repeats,
        max_rounds=2 * repeats,
    )
    return {
        "faults": {k: med(v) if v else 0 for k, v in faults.items()},
        "m": plan.micro_batches,
        "b": plan.micro_batch_size,
        "B": plan.global_batch,
        "times": times,
    }


# --------------------------------------------------------------------------- 3. per action


def action_worker(spec: dict[str, Any], plans: list[Any], repeats: int) -> dict:
    """A near-empty 2-stage model: step time against m, ours and hand-written, and the
    stages' compute alone; the slope over m is the per-micro-batch fixed cost."""
    torch.set_num_threads(1)
    rank = _init()
    return {"rank": rank, "rows": [_action(spec, plan, repeats) for plan in plans]}


def _action(spec: dict[str, Any], plan: Any, repeats: int) -> dict[str, Any]:
    x, y = batch(spec, plan.global_batch)
    pm = ours(build(spec), plan, spec, x)
    hw = Handwritten(build(spec), plan, spec, x)
    compute = _stage_compute(pm, spec, plan)
    c = Clock()  # a few µs per action: negligible against the ~0.5 ms being measured
    _wrap_stage(c, pm.stage.pipeline_stage, pm.schedule)
    times = alternate(
        {
            "ours": lambda: pm.step(x, y),
            "torch": lambda: hw.step(x, y),
            "compute": compute,
            "ours, fx codegen": codegen(pm, lambda: pm.step(x, y)),
        },
        repeats=repeats,
        clocks={"ours": c},
    )
    c.restore()
    return {"m": plan.micro_batches, "b": plan.micro_batch_size, "times": times}


# --------------------------------------------------------------------------- helpers


def med(xs: list[float]) -> float:
    return statistics.median(xs)
