"""The model split at a plan's split points (runtime.split), in one process."""

from __future__ import annotations

from typing import Any

import torch
from small_examples import batch, build
from torch import nn


def test_pipeline_splits_at_the_first_call_of_a_module_called_twice() -> None:
    from runtime.split.pipeline import split_pipeline
    from runtime.split.used import used_tensors

    torch.manual_seed(0)
    model = build("resnet").eval()
    x, _ = batch("resnet", 2, 0)
    # BasicBlock applies `relu` twice; the split point is its first call.
    pipe, _ = split_pipeline(model, ["stages.2.0.relu"], ((x,), {}))
    assert pipe.num_stages == 2
    assert "forward" not in model.get_submodule("stages.2.0.relu").__dict__
    with torch.no_grad():
        torch.testing.assert_close(pipe(x)[0], model(x))
    kept = [used_tensors(pipe.get_stage_module(i)) for i in range(2)]
    assert "stages.2.0.conv1.0.weight" in kept[0] and "fc.weight" in kept[1]


def test_pipeline_stage_keeps_only_what_it_reads() -> None:
    from runtime.split.pipeline import split_pipeline
    from runtime.split.used import used_tensors

    torch.manual_seed(0)
    gpt = build("gpt")
    x, _ = batch("gpt", 2, 0)
    pipe, _ = split_pipeline(gpt, ["blocks.1"], ((x,), {}))
    first, last = (pipe.get_stage_module(i) for i in range(2))
    # pipeline() leaves the untouched original head.weight in stage 0 beside its copy.
    assert "head.weight" in dict(first.named_parameters())
    assert "head.weight" not in used_tensors(first)
    assert {"tok_emb.weight"} <= used_tensors(first) and "head.weight" in used_tensors(last)


def _gpt_in_two() -> tuple[nn.Module, Any, nn.Module, nn.Module, tuple[Any, ...], Any]:
    """The GPT example split by pipeline() at blocks.1: (model, pipe, first, last, the first
    stage's output, the last stage's)."""
    from runtime.split.pipeline import split_pipeline

    torch.manual_seed(0)
    gpt = build("gpt")
    x, _ = batch("gpt", 2, 0)
    pipe, _ = split_pipeline(gpt, ["blocks.1"], ((x,), {}))
    first, last = (pipe.get_stage_module(i) for i in range(2))
    h = first(x)
    h = h if isinstance(h, tuple) else (h,)
    return gpt, pipe, first, last, h, last(*h)


def _unregistered(stage: nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    """(module type, name, tensor) of what modules kept as plain attributes hold (export's
    InterpreterModule keeps an unregistered graph_module)."""
    return [
        (type(v).__name__, name, t)
        for m in stage.modules()
        for v in vars(m).values()
        if isinstance(v, nn.Module)
        for name, t in v.state_dict(keep_vars=True).items()
    ]


def test_a_stage_lets_go_of_the_tensors_it_does_not_read() -> None:
    from runtime.split.used import prune_unused, used_tensors

    _, _, first, last, h, expected = _gpt_in_two()
    for stage in (first, last):
        prune_unused(stage, used_tensors(stage))
        held = {id(t) for t in stage.state_dict(keep_vars=True).values()}
        # The graph_modules keep the tensors their modules had: stage 0's unread head.weight,
        # the last stage's head the model's own tied weight (its stage holds pipeline()'s
        # copy). Kept, each stayed alive for the whole run.
        for kind, name, t in _unregistered(stage):
            assert t.is_meta or id(t) in held, (kind, name)
    assert "head.weight" not in first.state_dict()
    torch.testing.assert_close(last(*h), expected)


def test_a_rank_releases_the_other_stages_tensors_and_keeps_its_own() -> None:
    from runtime.split.used import release_others

    gpt, pipe, first, last, h, expected = _gpt_in_two()
    own = {n: p.data_ptr() for n, p in last.named_parameters()}
    others = sum(t.numel() * t.element_size() for t in first.state_dict().values())
    assert any(kind == "GraphModule" for kind, _, _ in _unregistered(first))
    released = release_others([pipe.split_gm], keep=last)
    assert released >= others * 0.99
    assert all(t.is_meta for t in first.state_dict().values())
    assert all(t.is_meta for _, _, t in _unregistered(first))
    assert {n: p.data_ptr() for n, p in last.named_parameters()} == own  # the same tensors
    assert not any(t.is_meta for t in gpt.state_dict().values())  # the model's own modules: kept
    torch.testing.assert_close(last(*h), expected)


def test_fx_split_passes_long_skips_along_the_chain() -> None:
    from runtime.split import split_model

    torch.manual_seed(0)
    unet = build("unet").eval()
    x, _ = batch("unet", 2, 0)
    mods, shapes = split_model(unet, ["down.1", "up.0"], ((x,), {}))
    with torch.no_grad():
        out = mods[2](*mods[1](*mods[0](x)))
        torch.testing.assert_close(out, unet(x))
    # Stage 1 receives the main path and down.0's skip; stage 2 also down.1's skip.
    assert len(shapes[1][0]) == 2 and len(shapes[2][0]) == 3


class _FanOut(nn.Module):
    """A table made in stage 0 and read by stages 1, 2 and 3; an input read by stage 3."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.d = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        table = torch.cos(self.a.weight[:, :1].T)  # (1, 8), read by every later stage
        h = self.a(x)
        h = self.b(h) * table
        h = self.c(h).T.T * table  # a non-contiguous view crosses the next split?
        h = torch.relu_(self.d(h)) * table * scale
        return {"logits": h, "first": h[:, :2], "early": table}  # table: made in stage 0


def _chain(pipe: Any, args: tuple[Any, ...]) -> Any:
    out: Any = args
    for i in range(pipe.num_stages):
        out = pipe.get_stage_module(i)(*(out if isinstance(out, tuple) else (out,)))
    return out


def test_relay_gives_each_stage_only_its_neighbours_values() -> None:
    from runtime.split.pipeline import split_pipeline

    torch.manual_seed(0)
    model = _FanOut()
    x, scale = torch.randn(4, 8), torch.full((4, 1), 0.5)
    pipe, restore = split_pipeline(model, ["b", "c", "d"], ((x, scale), {}))
    graph = pipe.split_gm.graph
    stages = [n for n in graph.nodes if n.op == "call_module"]
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    assert list(stages[0].args) == inputs  # the first stage takes every model input
    for i in range(1, len(stages)):
        sources = {a.args[0] for a in stages[i].args}
        assert sources == {stages[i - 1]}, f"stage {i} reads {sources}"
    for stage in stages[:-1]:  # one reader per output: every gradient has one way back
        for item in stage.users:
            assert len(item.users) == 1
    with torch.no_grad():
        got, want = restore(_chain(pipe, (x, scale))), model(x, scale)
    assert set(got) == {"logits", "first", "early"}  # the model's own dict, rebuilt
    for key in got:
        torch.testing.assert_close(got[key], want[key])


def test_stages_send_contiguous_tensors_and_clone_what_they_write_into() -> None:
    from runtime.split.pipeline import split_pipeline

    class Transposed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 12)
            self.act = nn.ReLU(inplace=True)
            self.b = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x).reshape(2, 3, 4).transpose(1, 2)  # a view crosses the split
            return self.b(self.act(h).transpose(1, 2))

    torch.manual_seed(0)
    model = Transposed()
    x = torch.randn(2, 8)
    pipe, _ = split_pipeline(model, ["act"], ((x,), {}))
    first, last = pipe.get_stage_module(0), pipe.get_stage_module(1)
    sent = first(x)
    sent = sent if isinstance(sent, tuple) else (sent,)
    assert all(t.is_contiguous() for t in sent)
    # The second stage's input is a leaf that requires grad, as a receive buffer is;
    # its first op (an in-place ReLU) works on a clone, and its gradient comes back dense.
    leaves = [t.detach().clone().requires_grad_(True) for t in sent]
    out = last(*leaves)
    out.sum().backward()
    assert all(t.grad is not None and t.grad.is_contiguous() for t in leaves)
    torch.testing.assert_close(out, model(x))


def test_the_stages_run_their_generated_code_with_the_same_values() -> None:
    """[Note: the stages run generated code]: no stage module is interpreted node by node,
    and forward and backward give what the interpreted stages give."""
    from torch.export.unflatten import InterpreterModule

    from runtime.split.pipeline import compiled, split_pipeline

    torch.manual_seed(0)
    gpt = build("gpt")
    x, _ = batch("gpt", 2, 0)
    pipe, _ = split_pipeline(gpt, ["blocks.1"], ((x,), {}))
    inner = [  # those export finalized (a container never called has no code)
        m
        for m in pipe.split_gm.modules()
        if isinstance(m, InterpreterModule) and "graph_module" in m.__dict__
    ]
    assert inner and not any(m._run_with_interpreter for m in inner)

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        pipe.split_gm.zero_grad()
        out = pipe(x)[0]
        out.float().square().mean().backward()
        return out.detach(), [
            p.grad.clone() for p in pipe.split_gm.parameters() if p.grad is not None
        ]

    out, grads = run()
    for m in inner:
        m._run_with_interpreter = True
    ref, ref_grads = run()
    torch.testing.assert_close(out, ref)
    assert len(grads) == len(ref_grads) > 0
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r)
    assert compiled(pipe.split_gm) == len(inner)  # the count of modules it switched


def test_a_submodule_named_self_runs_as_generated_code() -> None:
    """BERT's ``attention.self``: its call's node, named ``self``, must not hide the module in
    the generated code (the first try failed: "'Tensor' object has no attribute 'output'")."""
    from runtime.split.pipeline import split_pipeline

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.self = nn.Linear(8, 8)
            self.output = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.output(self.self(x))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.ModuleList([Attention(), Attention()])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for blk in self.layer:
                x = x + blk(x)
            return x

    torch.manual_seed(0)
    net = Net()
    x = torch.randn(4, 8)
    ref = net(x)
    pipe, _ = split_pipeline(net, ["layer.1"], ((x,), {}))
    torch.testing.assert_close(pipe(x)[0], ref)
