"""Blocks: split points, crossing bytes (hand-computed), exclusions, ties, granularity."""

from __future__ import annotations

import pytest
import torch
from repo import EXAMPLES
from torch import nn

from planner.capture import capture
from planner.capture.blocks import build_blocks
from planner.capture.subgraph import extract
from planner.plan.modelfile import load_model_file


class Skip(nn.Module):
    """h = a(x); y = b(h); z = c(y) + h + x[:, :1]: h skips over b, x over everything."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        y = self.b(h)
        return self.c(y) + h + x[:, :1]


def test_crossing_bytes_with_a_skip_connection_are_exact() -> None:
    model = Skip()
    x = torch.randn(2, 4)  # fp32
    cap = capture(model, (x,))
    chain = build_blocks(cap, model)
    assert [b.name for b in chain.blocks] == ["a", "b", "c"]
    # At b: h (2×8×4 B = 64) and x (2×4×4 B = 32, read again at the end).
    # At c: y (64) + h (64) + x (32). (x[:, :1] is computed in c's block: after c.)
    assert [b.boundary_bytes for b in chain.blocks] == [0, 64 + 32, 64 + 64 + 32]
    assert [b.crossing for b in chain.blocks] == [
        [],
        ["x: float32[2, 4]", "linear: float32[2, 8]"],
        ["x: float32[2, 4]", "linear: float32[2, 8]", "linear_1: float32[2, 8]"],
    ]
    assert [b.output_bytes for b in chain.blocks] == [64, 64, 2 * 8 * 4]
    assert [n.name for n in chain.blocks[2].inputs] == ["x", "linear", "linear_1"]
    assert chain.excluded == []


def test_blocks_run_alone_reproduce_the_model() -> None:
    model = Skip()
    x = torch.randn(2, 4)
    cap = capture(model, (x,))
    chain = build_blocks(cap, model)
    env = dict(zip([n for n in cap.gm.graph.nodes if n.op == "placeholder"], [x], strict=True))
    for block in chain.blocks:
        outs = extract(cap.gm, block.nodes, block.inputs, block.outputs)(
            *[env[n] for n in block.inputs]
        )
        env.update(zip(block.outputs, outs, strict=True))
    torch.testing.assert_close(env[chain.blocks[-1].outputs[-1]], model(x))


class TupleCrossing(nn.Module):
    """A tuple produced before b is unpacked after it: b cannot be a split point."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.a(x).split(4, dim=1)
        y = self.b(parts[0])
        return self.c(y + parts[1])


def test_split_point_with_a_non_tensor_crossing_is_excluded(monkeypatch) -> None:
    # symbolic_trace reads tuple items where they are used, so the tuple crosses b's start.
    monkeypatch.setattr(torch.export, "export", _fail)
    model = TupleCrossing()
    cap = capture(model, (torch.randn(2, 4),))
    assert cap.method == "symbolic_trace"
    chain = build_blocks(cap, model)
    assert [b.name for b in chain.blocks] == ["a", "c"]
    [excluded] = chain.excluded
    assert excluded.fqn == "b"
    assert "non-tensor" in excluded.reason and "tuple" in excluded.reason


def _fail(*args, **kwargs):
    raise RuntimeError("export disabled for this test")


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(self.emb(idx))))


def test_tied_parameters_are_found_by_identity() -> None:
    model = Tied()
    cap = capture(model, (torch.randint(0, 50, (2, 3)),))
    chain = build_blocks(cap, model)
    assert [b.name for b in chain.blocks] == ["emb", "mid", "head"]
    assert chain.tied == [(("emb.weight", "head.weight"), (0, 2))]


class CalledTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.shared = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(self.b(self.shared(self.a(x))))


def test_second_call_of_a_module_is_not_a_split_point() -> None:
    model = CalledTwice()
    cap = capture(model, (torch.randn(2, 4),))
    chain = build_blocks(cap, model)
    assert [b.name for b in chain.blocks] == ["a", "shared", "b"]
    assert [e.fqn for e in chain.excluded] == ["shared"]
    assert "more than once" in chain.excluded[0].reason


def test_containers_are_descended() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
    cap = capture(model, (torch.randn(3, 4),))
    chain = build_blocks(cap, model, target_blocks=1)
    assert [b.name for b in chain.blocks] == ["0", "1", "2.0", "2.1"]


def test_granularity_descends_into_heavy_modules_only() -> None:
    mf = load_model_file(EXAMPLES / "gpt.py")
    model = mf.module.build_model(n_layers=2)
    batch = mf.sample(2)
    cap = capture(model, batch.args, batch.kwargs)
    coarse = build_blocks(cap, model, target_blocks=2)
    fine = build_blocks(cap, model, target_blocks=64)
    assert len(coarse.blocks) < len(fine.blocks)
    assert all(b.name.count(".") <= 1 for b in coarse.blocks)  # whole transformer blocks


@pytest.mark.slow
def test_gpt_with_48_layers_can_balance_64_stages(monkeypatch) -> None:
    monkeypatch.setenv("GPT_SEQ", "32")
    monkeypatch.setenv("GPT_VOCAB", "4096")
    mf = load_model_file(EXAMPLES / "gpt.py")
    model = mf.module.build_model(n_layers=48, dim=64, n_heads=2)
    batch = mf.sample(2)
    cap = capture(model, batch.args, batch.kwargs)
    weights = {}

    def weight(node):
        w = float(_flops(node)) + 1.0
        weights[node] = w
        return w

    chain = build_blocks(cap, model, target_blocks=64, node_weight=weight)
    assert len(chain.blocks) >= 64
    total = sum(weights.values())
    leaves = {name for name, m in model.named_modules() if not list(m.children())}
    for block in chain.blocks:
        if block.weight > total / 64:
            # Only a single leaf module (e.g. the LM head) may be heavier.
            assert len(block.modules) == 1 and block.modules[0] in leaves, block.name


def _flops(node) -> int:
    """A static FLOP estimate for linear layers (enough to drive the granularity rule)."""
    if node.target is torch.ops.aten.linear.default:
        x, w = node.args[0].meta["val"], node.args[1].meta["val"]
        return 2 * x.numel() * w.shape[0]
    return 0


class DataDependent(nn.Module):
    """b's input has as many rows as a's output has positive first entries (nonzero)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        keep = torch.nonzero(h[:, 0] > -1e9).squeeze(1)
        return self.c(self.b(torch.index_select(h, 0, keep)))


def test_split_point_with_a_data_dependent_shape_crossing_is_excluded() -> None:
    model = DataDependent()
    cap = capture(model, (torch.randn(3, 4),))
    assert cap.method == "export"  # the data-dependent size no longer stops export
    chain = build_blocks(cap, model)
    assert [b.name for b in chain.blocks] == ["a"]
    assert {e.fqn for e in chain.excluded} == {"b", "c"}
    reason = next(e.reason for e in chain.excluded if e.fqn == "b")
    assert "data-dependent shape" in reason and "index_select" in reason and "[3, 4]" in reason
