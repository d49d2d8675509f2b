"""The model split at a plan's split points (runtime.split), in one process."""

from __future__ import annotations

import torch
from small_examples import batch, build


def test_pipeline_splits_at_the_first_call_of_a_module_called_twice() -> None:
    from runtime.split.pipeline import split_pipeline
    from runtime.split.used import used_tensors

    torch.manual_seed(0)
    model = build("resnet").eval()
    x, _ = batch("resnet", 2, 0)
    # BasicBlock applies `relu` twice; the split point is its first call.
    pipe = split_pipeline(model, ["stages.2.0.relu"], ((x,), {}))
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
    pipe = split_pipeline(gpt, ["blocks.1"], ((x,), {}))
    first, last = (pipe.get_stage_module(i) for i in range(2))
    # pipeline() leaves the untouched original head.weight in stage 0 beside its copy.
    assert "head.weight" in dict(first.named_parameters())
    assert "head.weight" not in used_tensors(first)
    assert {"tok_emb.weight"} <= used_tensors(first) and "head.weight" in used_tensors(last)


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
