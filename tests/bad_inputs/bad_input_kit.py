"""The bad-input matrix's kit: tiny model files, and the harness that runs the CLI in-process.

Each case (tests/bad_inputs/test_bad_*.py, cases 1-15 of
shared/reference/reliability.md) drives ``planner plan`` / ``planner show`` on a
tiny model file and checks: the error type (or the warning, or the correct
behaviour), a message that says what, why and how to fix it with the numbers,
exit status 1 with the message on stderr and no traceback, and that nothing was
written: no plan file, no profile-cache entry (:meth:`Env.refused`). Times are
analytic (``--device-type a100``) unless a case needs a measurement.
"""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest

from planner.cli import main
from planner.plan import Plan, load_plan

__all__ = [
    "A100",
    "BATCHNORM",
    "DATA_DEPENDENT",
    "GIB",
    "MLP",
    "STACK",
    "TIED",
    "TUPLE_EVERYWHERE",
    "TUPLE_ONCE",
    "WIDE",
    "Env",
    "cluster_file",
]

A100 = ("--device-type", "a100")
GIB = 2**30

# --------------------------------------------------------------------------- model files

MLP = """
import torch
from torch import nn

BATCH_SIZE = 8


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )


def sample_batch(batch_size):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, 16, generator=g), torch.randint(0, 4, (batch_size,), generator=g)
"""

DATA_DEPENDENT = """
import torch
from torch import nn


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.lin(x)
        return x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.gate = Gate()

    def forward(self, x):
        return self.gate(self.inp(x))


def build_model():
    return Net()


def sample_batch(batch_size):
    return torch.randn(batch_size, 4), torch.randn(batch_size, 4)
"""

# A tuple from `a` is read after `b` (and, in TUPLE_EVERYWHERE, after `c`): under
# symbolic_trace the tuple itself crosses those split points.
TUPLE_ONCE = """
import torch
from torch import nn

BATCH_SIZE = 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)

    def forward(self, x):
        parts = self.a(x).split(4, dim=1)
        y = self.b(parts[0])
        return self.c(y + parts[1])


def build_model():
    return Net()


def sample_batch(batch_size):
    return torch.randn(batch_size, 8), torch.randn(batch_size, 4)
"""
TUPLE_EVERYWHERE = TUPLE_ONCE.replace("self.c(y + parts[1])", "self.c(y) + parts[1]")

TIED = """
import torch
import torch.nn.functional as F
from torch import nn

BATCH_SIZE = 8


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.relu(self.mid(self.emb(idx))))


def build_model():
    return Net()


def sample_batch(batch_size):
    idx = torch.randint(0, 50, (batch_size, 6), generator=torch.Generator().manual_seed(0))
    return idx, idx


def loss_fn(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())
"""

BATCHNORM = """
from collections import OrderedDict

import torch
from torch import nn

BATCH_SIZE = 8


def build_model():
    layers = OrderedDict(inp=nn.Linear(16, 32), bn=nn.BatchNorm1d(32), act=nn.ReLU())
    return nn.Sequential(layers).append(nn.Linear(32, 4))


def sample_batch(batch_size):
    return torch.randn(batch_size, 16), torch.randint(0, 4, (batch_size,))
"""

# Four equal layers of 256 x 256: 1.0 MiB of parameters, gradients and Adam state each.
STACK = """
import torch
from torch import nn

BATCH_SIZE = 4


def build_model():
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])


def sample_batch(batch_size):
    return torch.randn(batch_size, 256), torch.randn(batch_size, 256)
"""

# One wide layer (4.1 MiB of state) among small ones.
WIDE = """
from collections import OrderedDict

import torch
from torch import nn

BATCH_SIZE = 4


def build_model():
    return nn.Sequential(
        OrderedDict(inp=nn.Linear(16, 64), wide=nn.Linear(64, 4096), out=nn.Linear(4096, 4))
    )


def sample_batch(batch_size):
    return torch.randn(batch_size, 16), torch.randint(0, 4, (batch_size,))
"""


def cluster_file(memory_gib: float, count: int = 2) -> str:
    """A cluster file of ``count`` A100s with ``memory_gib`` each."""
    return f"nodes:\n  - type: a100-80gb\n    count: {count}\n    memory_gib: {memory_gib}\n"


# --------------------------------------------------------------------------- the harness


@dataclasses.dataclass
class Env:
    """One case's folder, cache, output path, and the CLI run in-process."""

    tmp: Path
    capsys: pytest.CaptureFixture[str]
    monkeypatch: pytest.MonkeyPatch

    @property
    def cache(self) -> Path:
        return self.tmp / "cache"

    @property
    def out(self) -> Path:
        return self.tmp / "out" / "plan.yaml"

    def write(self, text: str, name: str = "model.py") -> Path:
        path = self.tmp / name
        path.write_text(textwrap.dedent(text))
        return path

    def cli(self, *argv: object) -> tuple[int, str, str]:
        self.capsys.readouterr()
        rc = main([str(a) for a in argv])
        out, err = self.capsys.readouterr()
        return rc, out, err

    def refused(self, *argv: object, command: str = "plan") -> str:
        """Run a command that must fail cleanly; return its stderr."""
        extra = ("--out", self.out) if command == "plan" else ()
        rc, out, err = self.cli(command, *argv, *extra)
        assert rc == 1, f"exit {rc}\n{out}\n{err}"
        assert "error: " in err, err
        assert "Traceback" not in err, err
        self.assert_nothing_written()
        return err

    def planned(self, *argv: object) -> tuple[Plan, str]:
        """Run `planner plan` that must succeed; return the saved plan and stdout."""
        rc, out, err = self.cli("plan", *argv, "--out", self.out)
        assert rc == 0, f"exit {rc}\n{out}\n{err}"
        return load_plan(self.out), out

    def assert_nothing_written(self) -> None:
        assert not self.out.exists(), "a plan file was written"
        leftovers = list(self.out.parent.iterdir()) if self.out.parent.exists() else []
        assert not leftovers, f"left behind: {leftovers}"
        entries = list(self.cache.iterdir()) if self.cache.exists() else []
        assert not entries, f"profile cache entries left behind: {entries}"
