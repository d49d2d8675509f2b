"""What a stage holds besides its blocks' own bytes: the batch it is handed, and the input
gradients GPipe keeps until its backward sends end ([Note: the batch a process holds],
[Note: the memory peak] in planner/cost/stage_memory.py)."""

from __future__ import annotations

from dataclasses import replace

from models import block_cost, cpu_cluster, model_profile, usable_cores

from planner.cost import CostModel, Layout
from planner.devices.build import from_gpus
from planner.options import Training
from planner.plan.records import ModelProfile

MB = 2**20


def _profile(device: str, *, inputs: int = 0, targets: int = 0) -> ModelProfile:
    """Two blocks of 1 Mi fp32 parameters; block 1 saves nothing, takes 8 MiB from block 0
    and makes 1 MiB of output (the model's)."""
    block_0 = block_cost(0, param_bytes=4 * MB, activation_bytes=8 * MB, output_bytes=8 * MB)
    block_1 = block_cost(1, param_bytes=4 * MB, activation_bytes=0, boundary_bytes=8 * MB)
    return model_profile([block_0, block_1], device, input_bytes=inputs, target_bytes=targets)


def _model(device: str, m: int, schedule: str = "gpipe", **sizes: int) -> CostModel:
    layout = Layout(pp=2, dp=1, micro_batches=m, schedule=schedule, ranks=((0,), (1,)))
    training = Training(global_batch=4 * m)
    prof = {device: _profile(device, **sizes)}
    if device == "h100":
        return CostModel(prof, from_gpus(2, "h100"), training, layout)
    with usable_cores(2):
        return CostModel(prof, cpu_cluster(2), training, layout)


def test_a_gpu_stage_holds_the_targets_on_the_last_stage_only() -> None:
    plain, fed = _model("h100", 4), _model("h100", 4, inputs=MB, targets=MB // 4)
    assert fed.memory(1, 1, 2).total - plain.memory(1, 1, 2).total == 4 * MB // 4
    # the first stage's inputs are its receive buffers already: as many with or without
    assert fed.memory(0, 0, 1).total - plain.memory(0, 0, 1).total == 4 * MB


def test_a_cpu_stage_holds_its_replicas_whole_batch() -> None:
    """On a CPU the runtime's feed hands every stage its replica's batch (runtime.data)."""
    plain, fed = _model("cpu", 4), _model("cpu", 4, inputs=MB, targets=MB // 4)
    assert fed.memory(1, 1, 2).total - plain.memory(1, 1, 2).total == 4 * (MB + MB // 4)
    assert fed.memory(0, 0, 1).total - plain.memory(0, 0, 1).total == 4 * (MB + MB // 4)


def test_gpipe_holds_every_input_gradient_it_sent_until_the_last_backward_ends() -> None:
    """Stage 1 (block 1) at m 4: 4 receive buffers of 8 MiB; per micro-batch the output
    and what the loss saves (1 + 1 MiB). At the last micro-batch's backward, after its
    loss's: its 2 MiB less the 1 the loss saved, the new 4 MiB parameter gradient, the
    gradients of the block's output (1) and input (8), and the input gradients of the
    three earlier micro-batches (24), held until GPipe's sends end: 70 MiB, beside the
    4 MiB of gradients. (The second backward holds 12 MiB less: 3 micro-batches' 2 MiB
    and one earlier input gradient.)"""
    mem = _model("h100", 4).memory(1, 1, 2)
    assert (mem.grads, mem.activations) == (
        4 * MB,
        32 * MB + 2 * MB - MB + 4 * MB + 9 * MB + 24 * MB,
    )
    # 1F1B waits for each send before the next backward: no such moment
    assert _model("h100", 4, schedule="1f1b").memory(1, 1, 2).activations < mem.activations
    # m 2: the last backward is the second, priced already
    two = _model("h100", 2).memory(1, 1, 2)
    assert two.activations == 16 * MB + 2 * MB - MB + 4 * MB + 9 * MB + 8 * MB


def test_integer_boundary_tensors_carry_no_gradient_back() -> None:
    """Ids and masks crossing a split point: the receiving stage's input buffers hold them,
    but no gradient buffer, no input gradient and no backward transfer is theirs."""

    def model(grads: int | None) -> CostModel:
        cm = _model("h100", 4)
        blocks = cm.basis.profile.blocks
        prof = replace(
            cm.basis.profile, blocks=(blocks[0], replace(blocks[1], boundary_grad_bytes=grads))
        )
        return CostModel({"h100": prof}, cm.basis.cluster, cm.basis.training, cm.layout)

    every, none = model(None), model(0)  # None: an older profile, every tensor's gradient
    # stage 0 receives no gradient for its 8 MiB output, in each of the 4 micro-batches
    assert every.memory(0, 0, 1).total - none.memory(0, 0, 1).total == 4 * 8 * MB
    assert none.memory(1, 1, 2).total < every.memory(1, 1, 2).total  # nor makes stage 1 one
    fwd, bwd = none.time.cut(0, 1)
    assert bwd < fwd and every.time.cut(0, 1) == (fwd, fwd)
