"""The runtime's peak memory on the CPU (runtime/measure/memory.py, live.py) against truths
computed another way.

* one process: a tiny MLP's step, counted by hand (parameters, Adam's state,
  the input and targets, and the three (B, H) tensors alive in ReLU's
  backward); a small GPT's step against the CPU allocator's own events (the
  profiler's ``profile_memory``: every allocation and free, in C++);
* two ranks (pp 2, and dp 2 with DDP's buckets): the :class:`Recorder`'s figure
  against the allocator's events, over the counted steps;
* ``planner run`` on 2 CPU ranks: each stage's measured peak beside the
  plan's prediction, for an activation-heavy MLP.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from runs import MLP, RUN_TIMEOUT_S, mlp_plan, planner_run
from small_examples import batch, build, loss_for
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function
from world import run_world

from planner.devices import from_gpus
from planner.options import PlanOptions, SearchOptions, Training
from planner.plan import Plan, load_plan, save_plan
from planner.plan.units import MIB
from planner.planning import plan_model
from runtime.measure.live import LiveTensors, live_tensors
from runtime.measure.memory import CPU_METHOD, MemoryProbe

TOLERANCE = 0.10  # the runtime's figure within 10 % of the true live-tensor peak
CPU = torch.device("cpu")


def _adam_step(model: nn.Module, opt: torch.optim.Optimizer, x: Any, y: Any, loss_fn: Any) -> None:
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()


def _alive_bytes() -> int:
    """Bytes of the CPU tensors this process holds already (other tests' leftovers in a
    full run): the probe counts every tensor alive, so the figures here are above these."""
    gc.collect()
    live = LiveTensors(CPU)
    live.add_all(live_tensors(CPU))
    return live.reconcile()


def _probe_peak(step: Callable[[], None], args: Any, steps: int = 2) -> float:
    """The probe as the Recorder runs it: one warm-up step, then ``steps`` counted ones."""
    probe = MemoryProbe(CPU)
    probe.start()
    with probe.step(args):
        step()
    probe.count_from_here()
    for _ in range(steps):
        with probe.step(args):
            step()
    peak, how = probe.peak()
    assert how == CPU_METHOD
    return peak


def test_a_tiny_mlp_steps_peak_is_the_hand_counted_one() -> None:
    """Linear(D, H) → ReLU → Linear(H, C), MSE, Adam; B samples; float32; steady state.

    The peak is inside ReLU's backward: its saved output r, the incoming
    gradient dL/dr and the outgoing dL/dh, three (B, H) tensors, over the
    parameters P, Adam's two moments 2P, the input and targets, and the
    second layer's gradients (already accumulated). h itself died in the
    forward (ReLU keeps its output, not its input); the first layer's
    gradients do not exist yet (zero_grad set them to None).
    """
    b, d, h, c = 256, 64, 512, 8
    base = _alive_bytes()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, c))
    opt = torch.optim.Adam(model.parameters())
    x, y = torch.randn(b, d), torch.randn(b, c)
    p = h * d + h + c * h + c
    floats = 3 * p + b * d + b * c + (c * h + c) + 3 * b * h
    expected = 4 * floats + 4 * 4  # + Adam's four float32 ``step`` scalars
    got = _probe_peak(lambda: _adam_step(model, opt, x, y, F.mse_loss), (x, y)) - base
    # Everything counted by hand is alive at that moment: a lower bound. Left out: the
    # loss's scalars and one more (B, C) tensor of its backward (0.4 % here).
    assert expected <= got <= expected * (1 + TOLERANCE), (got, expected)


def _allocator_peak(prof: Any, window: str, all_freed: bool = False) -> tuple[float, float]:
    """(live bytes when ``window`` began, their peak inside it), from the allocator's events.

    Every CPU allocation and free the profiler saw, in time order, summed: the
    truth for what was allocated after the profiler started. The profiler sees
    only this thread's events: a storage whose last reference a gloo thread drops
    (rank 1's flattened receive buffer in DDP's first broadcast, now and then)
    frees unseen. With ``all_freed`` (the caller deleted everything it made before
    the profiler stopped), an allocation whose free never shows was freed unseen,
    when is unknown: it is left out, and the truth is a lower bound for it.
    """
    events: list[tuple[int, int, int]] = []
    spans: list[tuple[int, int]] = []

    def walk(node: Any) -> None:
        if node.tag == torch._C._profiler._EventType.Allocation:
            fields = node.extra_fields
            if fields.device.type == "cpu":
                events.append((node.start_time_ns, fields.alloc_size, fields.ptr))
        elif node.name == window:
            spans.append((node.start_time_ns, node.end_time_ns))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    assert len(spans) == 1, spans
    events.sort()
    unfreed: dict[int, int] = {}  # ptr → index of its allocation's event
    unseen: set[int] = set()  # allocations whose free never shows
    for k, (_, nbytes, ptr) in enumerate(events):
        if nbytes > 0:
            if ptr in unfreed:  # the address came back: its last owner was freed unseen
                unseen.add(unfreed[ptr])
            unfreed[ptr] = k
        else:
            unfreed.pop(ptr, None)
    unseen.update(unfreed.values())
    skip = unseen if all_freed else set()
    lo, hi = spans[0]
    live, start, peak = 0, None, 0
    for k, (t, nbytes, _) in enumerate(events):
        if t >= lo and start is None:
            start = peak = live
        if k not in skip:
            live += nbytes
        if lo <= t <= hi:
            peak = max(peak, live)
    assert start is not None
    return float(start), float(peak)


def test_a_gpt_steps_peak_is_the_allocators() -> None:
    """The allocator's events, with the profiler on from before the model existed."""
    base = _alive_bytes()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.manual_seed(0)
        model = build("gpt")
        opt = torch.optim.Adam(model.parameters())
        x, y = batch("gpt", 8, 0)
        loss = loss_for("gpt")

        def step() -> None:
            _adam_step(model, opt, x, y, loss)

        step()  # warm-up: grads, Adam's state
        with record_function("counted"):
            got = _probe_peak(step, (x, y), steps=2) - base
    start, truth = _allocator_peak(prof, "counted")
    assert truth > start > 0
    assert got == pytest.approx(truth, rel=TOLERANCE), (got, truth)


# --------------------------------------------------------------------------- two ranks

STEPS = 3  # one warm-up, two counted
WORLD_TIMEOUT_S = 180


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    pp: int
    dp: int
    m: int
    schedule: str
    batch: int
    plan_path: str = ""


CASES = [
    Case("gpt-pp2-1f1b", "gpt", pp=2, dp=1, m=2, schedule="1f1b", batch=8),
    Case("mlp-dp2", "mlp", pp=1, dp=2, m=2, schedule="gpipe", batch=64),  # DDP's buckets
]


def _plan(case: Case) -> Plan:
    torch.manual_seed(0)
    x, y = batch(case.model, case.batch, 0)
    return plan_model(
        build(case.model),
        (x, y),
        cluster=from_gpus(case.pp * case.dp, "h100"),
        loss_fn=loss_for(case.model),
        options=PlanOptions(
            training=Training(global_batch=case.batch, optimizer="adam"),
            search=SearchOptions(
                pp=case.pp, dp=case.dp, micro_batches=case.m, schedule=case.schedule
            ),
        ),
        model_file=f"{case.model}.py",
    )


def _ranks(cases: list[Case]) -> dict[str, dict[str, Any]]:
    """Each rank: the Recorder's peak over the counted steps, and the allocator's."""
    from runtime.engine import ParallelModel
    from runtime.measure import Recorder

    out = {}
    for case in cases:
        gc.collect()  # the last case's tensors: gone before the allocator's count starts
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            batches = [batch(case.model, case.batch, k) for k in range(STEPS)]
            torch.manual_seed(0)
            pm = ParallelModel.from_plan(
                build(case.model),
                load_plan(case.plan_path),
                loss_fn=loss_for(case.model),
                optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3),
                sample=((batches[0][0],), {}),
            )
            rec = Recorder(pm, warmup_steps=1)
            pm.step(*batches[0])
            with record_function("counted"):
                for x, y in batches[1:]:
                    pm.step(x, y)
            record = rec.record()
            rec.close()
            del pm, rec, batches, x, y
            gc.collect()
        start, truth = _allocator_peak(prof, "counted", all_freed=True)
        out[case.name] = {
            "peak": record.peak_bytes,
            "how": record.memory_method,
            "truth": truth,
            "start": start,
        }
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("measure")
    cases = []
    for case in CASES:
        path = tmp / f"{case.name}.yaml"
        save_plan(_plan(case), path)
        cases.append(dataclasses.replace(case, plan_path=str(path)))
    return run_world(_ranks, 2, args=(cases,), timeout_s=WORLD_TIMEOUT_S)


@pytest.mark.multiprocess
@pytest.mark.timeout(WORLD_TIMEOUT_S + 120)
@pytest.mark.parametrize("case", [c.name for c in CASES])
def test_each_ranks_recorded_peak_is_the_allocators(
    two_ranks: list[dict[str, dict[str, Any]]], case: str
) -> None:
    """Pipeline receive buffers and DDP's buckets (allocated before the Recorder) included."""
    for rank, results in enumerate(two_ranks):
        got = results[case]
        assert got["how"] == CPU_METHOD
        assert got["peak"] == pytest.approx(got["truth"], rel=TOLERANCE), (rank, got)


# --------------------------------------------------------------------------- planner run

PLAN_TOLERANCE = 0.12
"""Measured vs predicted peak per stage, activation-heavy MLP on 2 CPU ranks, error =
(predicted − measured) / measured. Seen: −3 % and +9 % (17.3 vs 17.8 MiB, 11.2 vs 10.3:
the later-backward moment's new gradient, priced whole, overestimates stage 1). Before
each rank released the other stage's tensors (runtime.split.used.release_others): −11 %
and −17 %."""


@pytest.mark.multiprocess
@pytest.mark.timeout(RUN_TIMEOUT_S + 120)
def test_planner_run_reports_each_stages_peak_near_the_plans(tmp_path: Path) -> None:
    """MLP, 32 features, 512 samples in 2 micro-batches of 256, pp 2, GPipe: activations
    are about half of each stage's predicted peak."""
    plan, env = mlp_plan(tmp_path, global_batch=512)
    assert all(st.memory.activations > 0.4 * st.memory.total for st in plan.stages)
    rc, out, _ = planner_run([str(MLP), "--plan", "plan.yaml", "--steps", "3"], env, tmp_path)
    assert rc == 0, out
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("predicted vs measured"))
    assert lines[head + 1].split()[-3:] == ["MiB", "meas", "err"], lines[head + 1]
    for index, st in enumerate(plan.stages):
        row = lines[head + 2 + index]
        cells = row.split()
        predicted, measured = float(cells[-3]), float(cells[-2])
        assert predicted == pytest.approx(st.memory.total / MIB, abs=0.05)
        assert measured == pytest.approx(predicted, rel=PLAN_TOLERANCE), row
    assert f"memory measured as: {CPU_METHOD}" in out, out


def test_a_storage_resized_in_place_counts_at_its_size() -> None:
    """FSDP frees and re-allocates its gathered weights by ``storage.resize_``, which no
    dispatch mode sees: the size is read again at every exact total (a resize down) and
    when an op writes the storage (what follows a resize up)."""
    n = 1 << 20  # 4 MiB of float32
    live = LiveTensors(CPU)
    with live:
        freed = torch.empty(n)
        empty = torch.empty(0)
    freed.untyped_storage().resize_(0)  # as fsdp's free_storage
    base = live.reset_peak()
    with live:
        for buf in (freed, empty):
            buf.untyped_storage().resize_(4 * n)  # as fsdp's alloc_storage
            buf.set_(buf.untyped_storage(), 0, (n,)).fill_(1.0)
        other = torch.ones(n)
    assert live.peak - base == 3 * 4 * n, (live.peak - base) / MIB
    del freed, empty, other


def _dtensor_bytes() -> tuple[int, int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (2,))  # each rank's local tensor: half the DTensor
    live = LiveTensors(CPU)
    base = live.reset_peak()
    with live:
        shard = DTensor.from_local(torch.ones(1 << 18), mesh, [Shard(0)])
        doubled = shard * 2  # a DTensor born inside: its local tensor counts
    return live.peak - base, doubled.to_local().numel() * 4 + shard.to_local().numel() * 4


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_dtensor_counts_by_its_local_tensor() -> None:
    for got, want in run_world(_dtensor_bytes, 2, timeout_s=90):
        assert got == want, (got, want)
