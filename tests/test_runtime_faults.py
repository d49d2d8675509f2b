"""No hang when a rank fails (reliability items 18, 19, 24): ``planner run`` with 2 workers.

A small model file fails on demand on rank 1 (stage 1 of pp = 2), at step 3:
in its forward, in its backward, or with a batch one sample short. Each time
every process (torchrun's agent and both workers) must exit non-zero within
``BOUND_S`` of the start (and within ``AFTER_FAULT_S`` of the fault), none may
be left running, the failing rank must print the root cause once with its
rank/stage prefix, and the peer must flag its own error as a consequence.
A rank that hangs instead (alive, never answering) is given up on by its peer
after the collective timeout (``--timeout``), and then stopped by torchrun.
With ``--max-restarts 1`` and checkpoints, torchrun restarts the workers, which
resume from the last complete checkpoint and finish.

The fault sits in a custom op (``torch.library.custom_op``) whose registered
backward can fail too: ``pipeline()`` traces the model with torch.export,
which inlines a Python ``autograd.Function`` (its backward would be lost),
but keeps a custom op in the graph and runs its Python code at every call.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from test_runtime_launch import planner_run

from planner.api import PlanOptions, plan_model
from planner.cluster import from_gpus
from planner.cost import Training
from planner.modelfile import load_model_file
from planner.plan import save_plan
from planner.search import SearchOptions

BOUND_S = 60.0  # start to every process gone (measured: ~5-6 s on 2 CPU cores)
AFTER_FAULT_S = 10.0  # fault raised to every process gone (measured: ~0.3 s)
HANG_TIMEOUT_S = 5.0  # --timeout for the hang case: how long rank 0 waits for its peer
MICRO_BATCHES = 2

pytestmark = pytest.mark.multiprocess

FAULTY = '''"""A small MLP that fails on demand, on rank FAULT_RANK (default 1).

FAULT=forward|backward|hang: the FAULT_CALL-th real call of the last layer's tap
(a custom op) raises, in forward or in backward, or hangs. FAULT=shape: sample_batch
returns one sample short for step FAULT_STEP (the runtime seeds the data of
step n with seed + n). FAULT_STAMP: a file the fault writes its time to.
"""

import os
import time

import torch
from torch import nn

BATCH_SIZE = 8
_CALLS = {"forward": 0, "backward": 0}


def _armed(kind):
    rank = os.environ.get("RANK")
    return os.environ.get("FAULT") == kind and rank == os.environ.get("FAULT_RANK", "1")


def _stamp():
    if os.environ.get("FAULT_STAMP"):
        with open(os.environ["FAULT_STAMP"], "w") as f:
            f.write(repr(time.time()))


def _count(kind):
    if _armed("hang") and kind == "forward":
        _CALLS[kind] += 1
        if _CALLS[kind] == int(os.environ.get("FAULT_CALL", "1")):
            _stamp()
            time.sleep(600)  # alive, but never answers its peer
    if _armed(kind):
        _CALLS[kind] += 1
        if _CALLS[kind] == int(os.environ.get("FAULT_CALL", "1")):
            _stamp()
            raise RuntimeError(f"injected fault in {kind} (call {_CALLS[kind]})")


if not hasattr(torch.ops.faulty, "tap"):  # registered once per process

    @torch.library.custom_op("faulty::tap", mutates_args=())
    def _tap(x: torch.Tensor) -> torch.Tensor:
        _count("forward")
        return x.clone()

    @_tap.register_fake
    def _(x):
        return torch.empty_like(x)

    @torch.library.custom_op("faulty::tap_backward", mutates_args=())
    def _tap_backward(g: torch.Tensor) -> torch.Tensor:
        _count("backward")
        return g.clone()

    @_tap_backward.register_fake
    def _(g):
        return torch.empty_like(g)

    _tap.register_autograd(lambda ctx, g: torch.ops.faulty.tap_backward(g))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc0 = nn.Linear(16, 32)
        self.act0 = nn.ReLU()
        self.fc1 = nn.Linear(32, 32)
        self.act1 = nn.ReLU()
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        h = self.act1(self.fc1(self.act0(self.fc0(x))))
        return torch.ops.faulty.tap(self.fc2(h))


def build_model():
    return Net()


def sample_batch(batch_size):
    if _armed("shape") and torch.initial_seed() == int(os.environ.get("FAULT_STEP", "2")):
        _stamp()
        batch_size -= 1
    return torch.randn(batch_size, 16), torch.randint(0, 4, (batch_size,))
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("faults")
    (tmp / "faulty.py").write_text(FAULTY)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PLANNER_CACHE_DIR", str(tmp / "cache"))
        mf = load_model_file(tmp / "faulty.py")
        batch = mf.sample(mf.batch_size)
        plan = plan_model(
            mf.build(),
            (batch.args[0], batch.targets),
            cluster=from_gpus(2, "h100"),
            loss_fn=mf.loss,
            options=PlanOptions(
                training=Training(global_batch=mf.batch_size),
                search=SearchOptions(pp=2, micro_batches=MICRO_BATCHES, schedule="1f1b"),
            ),
            model_file="faulty.py",
        )
    assert plan.stages[1].modules[-1] == "fc2"  # the tap runs on stage 1
    save_plan(plan, tmp / "plan.yaml")
    return tmp


def _alive(token: str) -> list[int]:
    """Processes still running with FAULT_TOKEN=token in their environment."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes()
        except OSError:
            continue
        if f"FAULT_TOKEN={token}".encode() in env.split(b"\0"):
            found.append(int(proc.name))
    return found


def _fault_run(
    tmp: Path, fault: str, *extra: str, steps: int = 6, timeout: float = 30
) -> dict[str, Any]:
    token = uuid.uuid4().hex
    stamp = tmp / f"{fault}-{token}.stamp"
    env = {
        "FAULT": fault,
        "FAULT_RANK": "1",
        "FAULT_CALL": str(2 * MICRO_BATCHES + 1),  # the first micro-batch of step 3
        "FAULT_STEP": "2",  # step 3's data (steps count from 0 inside: seed + 2)
        "FAULT_STAMP": str(stamp),
        "FAULT_TOKEN": token,
        "PLANNER_CACHE_DIR": str(tmp / "cache"),
    }
    args = [
        "faulty.py",
        "--plan",
        "plan.yaml",
        "--steps",
        str(steps),
        "--timeout",
        str(timeout),
        *extra,
    ]
    rc, out, seconds = planner_run(args, env, tmp)
    ended = time.time()
    after = ended - float(stamp.read_text()) if stamp.exists() else None
    return {"rc": rc, "out": out, "seconds": seconds, "after": after, "alive": _alive(token)}


def _check_bounded(res: dict[str, Any], cause: str) -> None:
    out = res["out"]
    assert res["rc"] != 0, out
    assert res["seconds"] < BOUND_S, (res["seconds"], out)
    assert res["after"] is not None and res["after"] < AFTER_FAULT_S, (res["after"], out)
    assert res["alive"] == [], f"processes left running: {res['alive']}"
    line = f"[rank 1 r0 s1] failed at step 3: {cause}"
    assert sum(line in x for x in out.splitlines()) == 1, out  # the cause, once, with its rank
    assert "Root Cause" in out and cause in out.split("Root Cause", 1)[1], out  # torchrun agrees
    peer = [x for x in out.splitlines() if x.startswith("[rank 0 r0 s0] ")]
    if peer:  # rank 0 failed on its own (a closed connection) before torchrun stopped it
        assert any("another rank failed or stopped answering first" in x for x in peer), out
    assert "step 4/6" not in out, out


@pytest.mark.timeout(BOUND_S + 30)
def test_a_forward_that_raises_brings_every_rank_down(setup: Path) -> None:
    res = _fault_run(setup, "forward")
    _check_bounded(res, "RuntimeError: injected fault in forward (call 5)")


@pytest.mark.timeout(BOUND_S + 30)
def test_a_backward_that_raises_brings_every_rank_down(setup: Path) -> None:
    res = _fault_run(setup, "backward")
    _check_bounded(res, "RuntimeError: injected fault in backward (call 5)")


@pytest.mark.timeout(BOUND_S + 30)
def test_a_short_batch_on_one_rank_brings_every_rank_down(setup: Path) -> None:
    res = _fault_run(setup, "shape")
    _check_bounded(res, "ModelFileError:")
    assert "returned inputs with batch dimension 7; dim 0 should be 8" in res["out"]


@pytest.mark.timeout(BOUND_S + 30)
def test_a_rank_that_stops_answering_is_given_up_after_the_timeout(setup: Path) -> None:
    res = _fault_run(setup, "hang", timeout=HANG_TIMEOUT_S)
    out = res["out"]
    assert res["rc"] != 0, out
    assert res["alive"] == [], f"processes left running: {res['alive']}"
    # rank 0 waits HANG_TIMEOUT_S for its peer, fails, and torchrun stops the hung rank
    assert HANG_TIMEOUT_S <= res["after"] < HANG_TIMEOUT_S + AFTER_FAULT_S, (res["after"], out)
    assert "[rank 0 r0 s0] failed at step 3: " in out and "Timed out" in out, out
    assert "another rank failed or stopped answering first" in out, out


@pytest.mark.timeout(2 * BOUND_S + 30)
def test_restarted_workers_resume_from_the_last_complete_checkpoint(setup: Path) -> None:
    ckpt = setup / f"ckpt-{os.getpid()}"
    extra = ["--checkpoint-dir", ckpt.name, "--checkpoint-every", "2", "--max-restarts", "1"]
    res = _fault_run(setup, "forward", *extra, steps=4)
    out = res["out"]
    assert res["rc"] == 0, out
    assert "[rank 1 r0 s1] failed at step 3: RuntimeError: injected fault in forward" in out
    assert f"resumed from {ckpt.name}/step-00000002 (step 2)" in out, out
    assert "step 4/4" in out.split("resumed from", 1)[1], out
    assert (ckpt / "step-00000004" / "COMPLETE").is_file()
    assert res["alive"] == []
