"""No hang when a rank fails (reliability items 18, 19, 24, 27): ``planner run`` with 2 workers.

A small model file fails on demand on rank 1 (stage 1 of pp = 2), at step 3:
in its forward, in its backward, with a batch one sample short, or killed by
SIGKILL. Each time every process (torchrun's agent and both workers) must
exit, ``planner run`` non-zero, within ``BOUND_S`` of the start and within
``AFTER_FAULT_S`` of the fault; none may be left running; the failing rank
must print the root cause once with its rank/stage prefix (a killed rank
cannot: torchrun's summary and the agent's last line name it and its signal,
once), and the peer must flag its own error as a consequence.
A rank that hangs instead (alive, never answering) is given up on by its peer
after the collective timeout (``--timeout``), and then stopped by torchrun.

Exact resume: with ``--max-restarts 1`` and a checkpoint every 2 steps, a
worker killed at step 3 is restarted with its peer, both resume from step 2's
checkpoint, and the run's final checkpoint (weights, Adam's state, RNG
states) equals that of an uninterrupted run bit for bit. The uninterrupted
run pauses at step 3 for a look at its sockets: every one it listens on is
bound to 127.0.0.1.

The fault sits in a custom op (``torch.library.custom_op``) whose registered
backward can fail too: ``pipeline()`` traces the model with torch.export,
which inlines a Python ``autograd.Function`` (its backward would be lost),
but keeps a custom op in the graph and runs its Python code at every call.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from runs import RUN_TIMEOUT_S, alive, listening_addresses, planner_command, sockets

from planner.devices import from_gpus
from planner.options import PlanOptions, SearchOptions, Training
from planner.plan import save_plan
from planner.plan.modelfile import load_model_file
from planner.planning import plan_model

BOUND_S = 60.0  # start to every process gone (measured: 5.5-11.4 s on 2 busy CPU cores)
AFTER_FAULT_S = 10.0  # fault to every process gone (measured: 0.5-1.2 s, SIGKILL included)
HANG_TIMEOUT_S = 5.0  # --timeout for the hang case: how long rank 0 waits for its peer
MICRO_BATCHES = 2

pytestmark = pytest.mark.multiprocess

FAULTY = '''"""A small MLP that fails on demand, on rank FAULT_RANK (default 1).

FAULT=forward|backward|hang|kill|pause: the FAULT_CALL-th real call of the last
layer's tap (a custom op) raises, in forward or in backward; hangs; kills its own
process with SIGKILL; or sleeps FAULT_PAUSE_S and goes on. FAULT=shape: sample_batch
returns one sample short for step FAULT_STEP (the runtime seeds the data of
step n with seed + n). FAULT_STAMP: a file the fault writes its time to; once it
exists the fault is spent (a restarted worker does not fire it again).
"""

import os
import signal
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


def _fired():
    stamp = os.environ.get("FAULT_STAMP")
    return bool(stamp) and os.path.exists(stamp)  # once per run: not again after a restart


_ON = {"forward": ("forward", "kill", "hang", "pause"), "backward": ("backward",)}


def _count(kind):
    fault = os.environ.get("FAULT")
    if fault not in _ON[kind] or not _armed(fault) or _fired():
        return
    _CALLS[kind] += 1
    if _CALLS[kind] != int(os.environ.get("FAULT_CALL", "1")):
        return
    _stamp()
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)  # no exception, no error file, no goodbye
    elif fault == "hang":
        time.sleep(600)  # alive, but never answers its peer
    elif fault == "pause":
        time.sleep(float(os.environ.get("FAULT_PAUSE_S", "2")))  # a window to look at the run
    else:
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


def _fault_run(
    tmp: Path,
    fault: str,
    *extra: str,
    steps: int = 6,
    timeout: float = 30,
    during: Callable[[str], Any] | None = None,
) -> dict[str, Any]:
    """``planner run`` of the faulty model with FAULT=fault; ``during(token)`` runs at the fault."""
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
    args = ["faulty.py", "--plan", "plan.yaml", "--steps", str(steps), "--timeout", str(timeout)]
    args.append("--allow-device-mismatch")  # an H100 plan (analytic costs), run on the CPU
    cmd, full_env = planner_command([*args, *extra], env)
    log = tmp / f"{fault}-{token}.log"
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=full_env, cwd=tmp, stdout=out, stderr=subprocess.STDOUT)
        seen = None
        try:
            while proc.poll() is None and time.monotonic() - start < RUN_TIMEOUT_S:
                if during is not None and seen is None and stamp.exists():
                    seen = during(token)
                time.sleep(0.02)
            rc = proc.wait(timeout=1)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    seconds = time.monotonic() - start
    after = time.time() - float(stamp.read_text()) if stamp.exists() else None
    return {
        "rc": rc,
        "out": log.read_text(),
        "seconds": seconds,
        "after": after,
        "alive": alive(token),
        "during": seen,
    }


def _check_bounded(res: dict[str, Any]) -> None:
    out = res["out"]
    assert res["rc"] != 0, out
    assert res["seconds"] < BOUND_S, (res["seconds"], out)
    assert res["after"] is not None and res["after"] < AFTER_FAULT_S, (res["after"], out)
    assert res["alive"] == [], f"processes left running: {res['alive']}"
    peer = [x for x in out.splitlines() if x.startswith("[rank 0 r0 s0] ")]
    if peer:  # rank 0 failed on its own (a closed connection) before torchrun stopped it
        assert any("another rank failed or stopped answering first" in x for x in peer), out
    assert "step 4/6" not in out, out
    assert "Traceback (most recent call last)" not in out.split("Root Cause", 1)[0], out


def _check_cause(out: str, cause: str) -> None:
    line = f"[rank 1 r0 s1] failed at step 3: {cause}"
    assert sum(line in x for x in out.splitlines()) == 1, out  # the cause, once, with its rank
    assert "Root Cause" in out and cause in out.split("Root Cause", 1)[1], out  # torchrun agrees
    verdict = "planner run: rank 1 (local rank 1, pid "
    (last,) = [x for x in out.splitlines() if x.startswith(verdict)]  # and names the rank
    assert ") failed first, with exit status 1" in last, last


@pytest.mark.timeout(BOUND_S + 30)
def test_a_forward_that_raises_brings_every_rank_down(setup: Path) -> None:
    res = _fault_run(setup, "forward")
    cause = "RuntimeError: injected fault in forward (call 5)"
    _check_bounded(res)
    _check_cause(res["out"], cause)


@pytest.mark.timeout(BOUND_S + 30)
def test_a_backward_that_raises_brings_every_rank_down(setup: Path) -> None:
    res = _fault_run(setup, "backward")
    cause = "RuntimeError: injected fault in backward (call 5)"
    _check_bounded(res)
    _check_cause(res["out"], cause)


@pytest.mark.timeout(BOUND_S + 30)
def test_a_short_batch_on_one_rank_brings_every_rank_down(setup: Path) -> None:
    res = _fault_run(setup, "shape")
    _check_bounded(res)
    _check_cause(res["out"], "ModelFileError:")
    assert "returned inputs with batch dimension 7; dim 0 should be 8" in res["out"]


@pytest.mark.timeout(BOUND_S + 30)
def test_a_rank_killed_by_sigkill_brings_every_rank_down_and_is_named(setup: Path) -> None:
    res = _fault_run(setup, "kill")
    out = res["out"]
    _check_bounded(res)
    # no error of its own: torchrun's summary and the agent's line name the rank and signal
    root = out.split("Root Cause", 1)[1]
    assert "rank      : 1 (local_rank: 1)" in root and "exitcode  : -9" in root, out
    assert out.count("Signal 9 (SIGKILL) received by PID") == 1, out
    (verdict,) = [x for x in out.splitlines() if x.startswith("planner run: rank 1 ")]
    assert "was killed by signal 9 (SIGKILL), not by an error of its own" in verdict, verdict
    assert "[rank 1 r0 s1] failed" not in out, out  # it had no chance to say anything


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


# --------------------------------------------------------------------------- exact resume


def _listening(token: str) -> list[str]:
    """The local addresses of the listening sockets of the run's processes (its agent, workers)."""
    return listening_addresses(inodes=sockets(alive(token)))


@pytest.fixture(scope="module")
def straight(setup: Path) -> dict[str, Any]:
    """6 steps uninterrupted (a 2 s pause at step 3 to look at its sockets), checkpoint every 2."""
    ckpt = setup / "ckpt-straight"
    extra = ["--checkpoint-dir", ckpt.name, "--checkpoint-every", "2"]
    res = _fault_run(setup, "pause", *extra, during=_listening)
    assert res["rc"] == 0, res["out"]
    return {**res, "ckpt": ckpt}


def _checkpoint(path: Path) -> dict[str, Any]:
    """Everything a checkpoint holds, in one dict (read in this process, no process group)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = path.parent / f"{path.name}.pt"
    dcp_to_torch_save(path, flat)
    return torch.load(flat, weights_only=True)


def _assert_equal(a: Any, b: Any, where: str = "") -> None:
    import torch

    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, sorted(a), sorted(b))
        for k in a:
            _assert_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where  # bit for bit
    else:
        assert a == b, (where, a, b)


@pytest.mark.timeout(3 * BOUND_S + 30)
def test_a_killed_worker_is_restarted_and_ends_exactly_as_an_uninterrupted_run(
    setup: Path, straight: dict[str, Any]
) -> None:
    ckpt = setup / f"ckpt-killed-{os.getpid()}"
    extra = ["--checkpoint-dir", ckpt.name, "--checkpoint-every", "2", "--max-restarts", "1"]
    res = _fault_run(setup, "kill", *extra)  # SIGKILL at step 3: after step 2's checkpoint
    out = res["out"]
    assert res["rc"] == 0, out
    assert res["after"] is not None and res["alive"] == [], out
    assert f"resumed from {ckpt.name}/step-00000002 (step 2)" in out, out
    resumed = out.split("resumed from", 1)[1]
    steps = [x for x in resumed.splitlines() if x.startswith("step ")]
    assert [x.split()[1] for x in steps] == ["3/6", "4/6", "5/6", "6/6"], out
    reference = {
        x.split()[1]: x.split()[3] for x in straight["out"].splitlines() if x[:5] == "step "
    }
    assert {x.split()[1]: x.split()[3] for x in steps} == {
        k: v for k, v in reference.items() if k in ("3/6", "4/6", "5/6", "6/6")
    }  # the same losses, as printed
    final = _checkpoint(ckpt / "step-00000006")
    want = _checkpoint(straight["ckpt"] / "step-00000006")
    assert {k.split(".")[0] for k in want} == {"model", "optim", "rng", "step"}, sorted(want)
    _assert_equal(final, want)  # weights, Adam's moments and step counts, RNG states: bit for bit


@pytest.mark.timeout(BOUND_S + 30)
def test_a_local_run_listens_on_the_loopback_address_only(straight: dict[str, Any]) -> None:
    found = straight["during"]  # the agent's rendezvous store, rank 0's store, gloo's sockets
    assert found is not None and len(found) >= 3, found
    assert set(found) == {"127.0.0.1"}, found
