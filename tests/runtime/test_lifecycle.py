"""The job's lifecycle (issue 13): it ends with its launcher, one run per checkpoint folder,
and the causes of an early end said first, in one line.

``planner run`` of a small MLP (pp 2, CPU plan, 2 workers) whose steps are
slowed down (``LIFE_STEP_S``) so that a signal lands mid-training:

* SIGTERM or SIGINT (a Ctrl-C: sent to the launcher's process group, as a
  terminal does) to ``planner run``: every process of the job is gone within
  ``STOP_BOUND_S``, and the only line printed after the signal (besides the
  steps the workers had finished) names the last complete checkpoint and the
  command that resumes from it;
* SIGKILL to ``planner run`` alone: the agent and the workers die with it
  (``PR_SET_PDEATHSIG``);
* a second run on the same ``--checkpoint-dir`` is refused in one line
  naming the first (pid, host, start time, command); a lock left by a dead
  run is taken over, with a note;
* a busy ``--master-port``, ``sys.exit`` in the model file (``build_model``,
  ``loss_fn``), a disk full while checkpointing (the DCP writer made to fail
  with ENOSPC), a plan made for other devices: each said cause first.

Each signal case prints the seconds from the signal to the last process gone
(``pytest -s`` shows them). The lock alone: test_lock.py; a process dying with
its parent, alone: test_parent_death.py.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from models import cpu_cluster
from runs import RUN_TIMEOUT_S, alive, planner_command, planner_run

from planner.devices import from_gpus
from planner.options import PlanOptions, SearchOptions, Training
from planner.plan import load_plan, save_plan
from planner.plan.modelfile import load_model_file
from planner.planning import plan_model
from runtime.checks import PlanMismatch, check_device

pytestmark = pytest.mark.multiprocess

STOP_BOUND_S = 10.0  # signal to every process of the job gone (the brief's bound)
STEP_S = 0.25  # each sample_batch call sleeps this long: 300 steps would take minutes

LIFE = '''"""A small MLP whose run can be slowed, exited or starved of disk space on demand."""

import errno
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

BATCH_SIZE = 8


def build_model():
    if os.environ.get("LIFE_EXIT") == "build_model":
        sys.exit(3)
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )


def sample_batch(batch_size):
    time.sleep(float(os.environ.get("LIFE_STEP_S", "0")))
    return torch.randn(batch_size, 16), torch.randint(0, 4, (batch_size,))


def loss_fn(outputs, targets):
    if os.environ.get("LIFE_EXIT") == "loss_fn":
        sys.exit(4)
    return F.cross_entropy(outputs, targets)


if os.environ.get("LIFE_ENOSPC"):  # every checkpoint write fails as on a full disk
    from torch.distributed.checkpoint import filesystem

    def _full(self, plan, planner):
        path = os.path.join(str(self.path), "__0_0.distcp")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    filesystem._FileSystemWriter.write_data = _full
'''


def _plan(tmp: Path, name: str, cluster: Any) -> None:
    mf = load_model_file(tmp / "life.py")
    batch = mf.sample(mf.batch_size)
    plan = plan_model(
        mf.build(),
        (batch.args[0], batch.targets),
        cluster=cluster,
        loss_fn=mf.loss,
        options=PlanOptions(
            training=Training(global_batch=mf.batch_size),
            search=SearchOptions(pp=2, micro_batches=2, schedule="1f1b"),
        ),
        model_file="life.py",
    )
    save_plan(plan, tmp / name)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("life")
    (tmp / "life.py").write_text(LIFE)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PLANNER_CACHE_DIR", str(tmp / "cache"))
        _plan(tmp, "plan.yaml", cpu_cluster(2))
        _plan(tmp, "h100.yaml", from_gpus(2, "h100"))
    return tmp


def _env(tmp: Path, token: str, **extra: str) -> dict[str, str]:
    return {"FAULT_TOKEN": token, "PLANNER_CACHE_DIR": str(tmp / "cache"), **extra}


def _start(tmp: Path, args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    cmd, full_env = planner_command(args, env)
    with open(log, "w") as out:  # the child keeps its own descriptor
        return subprocess.Popen(
            cmd, env=full_env, cwd=tmp, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def _wait_for(log: Path, text: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while text not in log.read_text():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)


def _gone_after(token: str, proc: subprocess.Popen[bytes], start: float) -> float:
    """Seconds from ``start`` until planner run and every process of its job are gone."""
    while time.monotonic() - start < 3 * STOP_BOUND_S:
        if proc.poll() is not None and not alive(token):
            return time.monotonic() - start
        time.sleep(0.02)
    left = alive(token)
    for pid in left:  # do not leave them behind for the next test
        os.kill(pid, signal.SIGKILL)
    proc.kill()
    pytest.fail(f"still running {3 * STOP_BOUND_S:.0f} s after the signal: {left}")


def _signal_run(tmp: Path, how: str) -> dict[str, Any]:
    """A 300-step run with a checkpoint every 2 steps, sent ``how`` once step 3 is done."""
    token = uuid.uuid4().hex
    ckpt = f"ckpt-{how}-{token[:6]}"
    args = ["life.py", "--plan", "plan.yaml", "--steps", "300", "--checkpoint-dir", ckpt]
    args += ["--checkpoint-every", "2"]
    log = tmp / f"{how}-{token}.log"
    proc = _start(tmp, args, _env(tmp, token, LIFE_STEP_S=str(STEP_S)), log)
    try:
        _wait_for(log, "step 3/300", proc)
        mark = len(log.read_text())
        start = time.monotonic()
        if how == "ctrl-c":  # a terminal's Ctrl-C: SIGINT to the foreground process group
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
        seconds = _gone_after(token, proc, start)
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"\n{how}: every process gone {seconds:.2f} s after the signal")
    out = log.read_text()
    return {"rc": proc.returncode, "out": out, "after": out[mark:], "s": seconds, "args": args}


def _check_stopped(res: dict[str, Any], signame: str) -> None:
    assert res["s"] < STOP_BOUND_S, res
    noise = ("step ", "checkpoint saved: ")
    after = [x for x in res["after"].splitlines() if x.strip() and not x.startswith(noise)]
    assert len(after) == 1, res["after"]  # one line, no traceback, no torchrun log
    (line,) = after
    assert line.startswith(f"planner run: stopped by {signame}"), line
    m = re.search(r"the last complete checkpoint is (\S+) \(step (\d+)\); resume with: (.*)$", line)
    assert m, line
    path, step = Path(m.group(1)), int(m.group(2))
    assert step >= 2 and step % 2 == 0 and path.name == f"step-{step:08d}", line
    assert m.group(3) == "planner " + " ".join(["run", *res["args"]]), line


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_sigterm_to_planner_run_stops_the_job_and_says_how_to_resume(setup: Path) -> None:
    res = _signal_run(setup, "sigterm")
    assert res["rc"] == 128 + signal.SIGTERM, res["out"]
    _check_stopped(res, "SIGTERM")


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_ctrl_c_stops_the_job_in_one_line(setup: Path) -> None:
    res = _signal_run(setup, "ctrl-c")
    assert res["rc"] == 128 + signal.SIGINT, res["out"]
    _check_stopped(res, "SIGINT (Ctrl-C)")
    assert "Traceback" not in res["out"], res["out"]


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_sigkill_to_planner_run_takes_the_agent_and_workers_with_it(setup: Path) -> None:
    res = _signal_run(setup, "sigkill")  # _signal_run fails unless every process is gone
    assert res["rc"] == -signal.SIGKILL
    assert res["s"] < STOP_BOUND_S, res


# --------------------------------------------------------------------------- the lock


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_a_second_run_on_the_same_checkpoint_dir_is_refused(setup: Path) -> None:
    token = uuid.uuid4().hex
    args = ["life.py", "--plan", "plan.yaml", "--steps", "300", "--checkpoint-dir", "ckpt-lock"]
    first = _start(setup, args, _env(setup, token, LIFE_STEP_S=str(STEP_S)), setup / "lock1.log")
    try:
        _wait_for(setup / "lock1.log", "step 1/300", first)
        started = time.monotonic()
        rc, out, _ = planner_run([*args[:4], "5", *args[5:]], _env(setup, token), setup)
        refused_s = time.monotonic() - started
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=STOP_BOUND_S)
    assert rc == 1, out
    (line,) = [x for x in out.splitlines() if x.strip()]
    assert line.startswith("error: checkpoint folder ckpt-lock is in use by another run (pid "), (
        line
    )
    assert f"on {socket.gethostname()}, started 20" in line, line
    assert "running `planner run life.py --plan plan.yaml --steps 300" in line, line
    assert "give this one another --checkpoint-dir" in line, line
    assert refused_s < 30, refused_s  # before any worker starts
    assert not (setup / "ckpt-lock" / "step-00000005").exists()


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_a_lock_left_by_a_dead_run_is_taken_over_with_a_note(setup: Path) -> None:
    ckpt = setup / "ckpt-stale"
    ckpt.mkdir()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    (ckpt / "LOCK").write_text(
        f'{{"pid": {dead.stdout.strip()}, "host": "gone", "started": "2026-01-01 00:00:00 UTC", '
        '"command": "planner run old.py"}\n'
    )
    args = ["life.py", "--plan", "plan.yaml", "--steps", "2", "--checkpoint-dir", ckpt.name]
    rc, out, _ = planner_run(args, _env(setup, uuid.uuid4().hex), setup)
    assert rc == 0, out
    note = [x for x in out.splitlines() if "taking over the lock" in x]
    assert len(note) == 1 and f"pid {dead.stdout.strip()} on gone" in note[0], out
    assert (ckpt / "step-00000002" / "COMPLETE").is_file()
    assert (ckpt / "LOCK").read_text() == ""  # released at the end: nothing to take over


# --------------------------------------------------------------------------- causes, first


@pytest.mark.timeout(60)
def test_a_busy_master_port_is_named_before_launching(setup: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        args = ["life.py", "--plan", "plan.yaml", "--steps", "1", "--master-port", str(port)]
        rc, out, _ = planner_run(args, _env(setup, uuid.uuid4().hex), setup)
    assert rc == 1, out
    (line,) = [x for x in out.splitlines() if x.strip()]
    assert line.startswith(f"error: --master-port {port} is already in use on 127.0.0.1"), line
    assert "--master-port 0 for a free one" in line, line


def _failed_run(setup: Path, *extra: str, **env: str) -> str:
    args = ["life.py", "--plan", "plan.yaml", "--steps", "4", *extra]
    token = uuid.uuid4().hex
    rc, out, _ = planner_run(args, _env(setup, token, **env), setup)
    assert rc == 1, out
    assert alive(token) == [], out
    return out


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
@pytest.mark.parametrize(  # build_model exits on both ranks, loss_fn on the last stage's
    ("where", "code", "rank"), [("build_model", 3, r"\d"), ("loss_fn", 4, "1")]
)
def test_sys_exit_in_the_model_file_is_named_as_such(
    setup: Path, where: str, code: int, rank: str
) -> None:
    out = _failed_run(setup, LIFE_EXIT=where)
    want = re.compile(
        rf"\[rank {rank}[^\]]*\] failed [^:]+: ModelFileExit: the model file life.py called "
        rf"sys.exit\({code}\) at life.py:\d+ in {where}; a model file must return or raise"
    )
    assert any(want.search(x) for x in out.splitlines()), out
    assert "killed by signal" not in out, out
    (verdict,) = [x for x in out.splitlines() if x.startswith("planner run: rank ")]
    assert "failed first, with exit status 1" in verdict, verdict


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_a_full_disk_while_checkpointing_says_so_and_names_the_folder(setup: Path) -> None:
    out = _failed_run(setup, "--checkpoint-dir", "ckpt-full", LIFE_ENOSPC="1")
    lines = [x for x in out.splitlines() if "No space left on device in ckpt-full" in x]
    assert lines and "failed saving the final checkpoint: No space left on device" in lines[0], out
    assert "free space there or give another --checkpoint-dir" in lines[0], out
    assert "CheckpointException ranks" not in "\n".join(lines), out


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_a_really_full_disk_says_so_too(setup: Path) -> None:
    tiny = setup / f"tiny-{uuid.uuid4().hex[:6]}"
    tiny.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=12k", "tmpfs", str(tiny)]
    if subprocess.run(mount, capture_output=True, timeout=30).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:  # 3 pages: the lock fits, a checkpoint's files do not
        out = _failed_run(setup, "--checkpoint-dir", str(tiny / "ckpt"))
    finally:
        subprocess.run(["umount", str(tiny)], timeout=30)
    lines = [x for x in out.splitlines() if f"No space left on device in {tiny}/ckpt" in x]
    assert lines and "free space there or give another --checkpoint-dir" in lines[0], out


@pytest.mark.timeout(60)
def test_a_gpu_plan_is_refused_on_a_machine_without_a_gpu(setup: Path) -> None:
    if check_device(load_plan(setup / "plan.yaml"), gpu_name=None) is not None:
        pytest.skip("this machine has a GPU")
    rc, out, _ = planner_run(["life.py", "--plan", "h100.yaml"], _env(setup, "x"), setup)
    assert rc == 1, out
    (line,) = [x for x in out.splitlines() if x.strip()]
    assert line.startswith("error: the plan of life.py was made for h100 devices, but this "), line
    assert "pass --allow-device-mismatch to run it here anyway" in line, line


def test_device_types_are_compared_with_this_machine(setup: Path) -> None:
    cpu, h100 = load_plan(setup / "plan.yaml"), load_plan(setup / "h100.yaml")
    assert check_device(cpu, gpu_name="") is None
    assert check_device(h100, gpu_name="NVIDIA H100 80GB HBM3") is None
    on_gpu = check_device(cpu, gpu_name="NVIDIA H100 80GB HBM3")
    assert on_gpu and "made for cpu devices, but runs on this machine's GPU" in on_gpu
    other = check_device(h100, gpu_name="NVIDIA A100-SXM4-80GB")
    assert other and "this machine's GPU is NVIDIA A100-SXM4-80GB" in other and "h100" in other
    with pytest.raises(PlanMismatch, match="no CUDA GPU"):
        check_device(h100, gpu_name="")
    forced = check_device(h100, gpu_name="", allow_mismatch=True)
    assert forced and "(--allow-device-mismatch)" in forced
