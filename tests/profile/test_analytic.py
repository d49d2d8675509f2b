"""Tests for planner.profile.analytic: FLOPs, bytes and roofline time of aten ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from planner.devices import get_device
from planner.profile.analytic import OpCost, OpCostMode, measure_cost


def _fwd_bwd(model: nn.Module, x: torch.Tensor, device=None, **kw) -> OpCostMode:
    with OpCostMode(device, **kw) as mode:
        with mode.phase("fwd"):
            loss = model(x).sum()
        with mode.phase("bwd"):
            loss.backward()
    return mode


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(16,), (4, 4)])  # 2-D input -> addmm; 3-D -> view + addmm
def test_linear_forward_is_2_b_in_out_bias_not_counted(bias, shape):
    b, n_in, n_out = 16, 24, 40
    layer = nn.Linear(n_in, n_out, bias=bias)
    x = torch.randn(*shape, n_in)
    cost = measure_cost(lambda: layer(x))
    # The registry counts addmm as its matmul only: the bias add is free.
    assert cost.flops == 2 * b * n_in * n_out


@pytest.mark.parametrize("input_grad", [True, False])
def test_linear_backward_is_4_or_2_b_in_out(input_grad):
    b, n_in, n_out = 8, 32, 48
    layer = nn.Linear(n_in, n_out)
    x = torch.randn(b, n_in, requires_grad=input_grad)
    mode = _fwd_bwd(layer, x)
    assert mode.phases["fwd"].flops == 2 * b * n_in * n_out
    # One mm for the weight gradient, one more for the input's when it needs one;
    # the bias gradient is a sum (0 FLOPs).
    assert mode.phases["bwd"].flops == (4 if input_grad else 2) * b * n_in * n_out


def test_bmm_and_matmul_are_2_b_m_k_n():
    b, m, k, n = 3, 5, 7, 11
    x, y = torch.randn(b, m, k), torch.randn(b, k, n)
    assert measure_cost(lambda: torch.bmm(x, y)).flops == 2 * b * m * k * n
    assert measure_cost(lambda: x @ y).flops == 2 * b * m * k * n
    # A batched matmul against one matrix folds the batch into the rows.
    w = torch.randn(k, n)
    assert measure_cost(lambda: x @ w).flops == 2 * b * m * k * n


def test_conv2d_flops():
    batch, c_in, c_out, h, w, kh, kw = 2, 3, 8, 16, 16, 3, 5
    conv = nn.Conv2d(c_in, c_out, (kh, kw), stride=2, padding=1)
    x = torch.randn(batch, c_in, h, w)
    with OpCostMode() as mode:
        out = conv(x)
    h_out, w_out = out.shape[-2:]
    assert mode.total.flops == 2 * c_out * h_out * w_out * c_in * kh * kw * batch


class _Block(nn.Module):
    """Attention + MLP + conv-free residual, enough op variety for parity checks."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(x)


def _model_and_input(device: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    with torch.device(device):
        model = nn.Sequential(
            nn.Conv1d(8, 32, 3, padding=1),
            nn.ReLU(),
            _Transpose(),
            _Block(),
            nn.Linear(32, 10),
        )
        x = torch.randn(2, 8, 16, requires_grad=True)
    return model, x


class _Transpose(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)


def test_meta_device_costing_equals_real_device_costing():
    h100 = get_device("h100")
    real = _fwd_bwd(*_model_and_input("cpu"), device=h100)
    meta = _fwd_bwd(*_model_and_input("meta"), device=h100)
    assert meta.total == real.total
    assert meta.phases == real.phases
    assert real.total.flops > 0 and real.phases["bwd"].ops > real.phases["fwd"].ops


def test_meta_backward_works_and_leaves_meta_grads():
    layer = nn.Linear(4096, 4096, device="meta")
    x = torch.randn(64, 4096, device="meta")
    mode = _fwd_bwd(layer, x, device=get_device("h100"))
    assert layer.weight.grad is not None and layer.weight.grad.is_meta
    assert mode.phases["bwd"].flops == 2 * 64 * 4096 * 4096


def test_attention_on_meta_takes_the_fused_path():
    q = torch.randn(2, 4, 128, 16, device="meta")
    with OpCostMode() as mode:
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    # One fused kernel: no 128x128 score matrix is written.
    assert mode.total.ops == 1
    assert mode.total.bytes_moved < 5 * q.numel() * 4
    assert mode.total.flops == 4 * 2 * 4 * 128 * 128 * 16  # q·kᵀ and p·v


def test_elementwise_add_moves_3_times_4_n_bytes():
    n = 1000
    a, b = torch.randn(n), torch.randn(n)
    cost = measure_cost(lambda: a + b)
    assert cost.bytes_moved == 3 * 4 * n
    assert cost.flops == 0 and cost.ops == 1


def test_in_place_add_reads_both_and_writes_one():
    a, b = torch.randn(100), torch.randn(100)
    assert measure_cost(lambda: a.add_(b)).bytes_moved == 3 * 4 * 100


def test_broadcast_input_counts_its_real_size():
    x, bias = torch.randn(64, 100), torch.randn(100)
    assert measure_cost(lambda: x + bias).bytes_moved == 4 * (64 * 100 * 2 + 100)


def test_views_cost_nothing():
    x = torch.randn(4, 6, 8)

    def views() -> None:
        y = x.view(24, 8).t().transpose(0, 1).reshape(4, 48).permute(1, 0)
        y.expand(2, 48, 4).detach()
        x.split(2, dim=0)
        x.unsqueeze(0).squeeze(0)[1:3, 0]

    assert measure_cost(views, get_device("h100")) == OpCost()


def test_dtype_override_bf16_halves_bytes_and_prices_bf16():
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    h100 = get_device("h100")
    fp32 = measure_cost(lambda: a @ b, h100)
    with OpCostMode(h100, dtype_override="bf16") as mode:
        a @ b
    bf16 = mode.total
    assert bf16.bytes_moved == fp32.bytes_moved / 2
    assert bf16.flops == fp32.flops
    assert bf16.time_s < fp32.time_s
    # Integer tensors keep their size.
    idx = torch.arange(100)
    with OpCostMode(dtype_override="bfloat16") as mode:
        idx + 1
    assert mode.total.bytes_moved == 2 * 8 * 100


def test_phase_accounting_sums_to_total():
    model, x = _model_and_input("cpu")
    a100 = get_device("a100")
    with OpCostMode(a100) as mode:
        with mode.phase("fwd"):
            loss = model(x).sum()
        with mode.phase("bwd"):
            loss.backward()
        x.detach().mul(2)  # outside any phase
    outside = measure_cost(lambda: x.detach().mul(2), a100)
    summed = mode.phases["fwd"] + mode.phases["bwd"] + outside
    assert summed.flops == mode.total.flops
    assert summed.bytes_moved == mode.total.bytes_moved
    assert summed.ops == mode.total.ops
    assert summed.time_s == pytest.approx(mode.total.time_s, rel=1e-12)


def test_nested_phases_count_in_each():
    x = torch.randn(10)
    with OpCostMode() as mode, mode.phase("step"):
        with mode.phase("fwd"):
            x + 1
        with mode.phase("bwd"):
            x * 2
    assert mode.phases["step"] == mode.phases["fwd"] + mode.phases["bwd"] == mode.total


def test_roofline_big_matmul_on_h100_is_compute_bound():
    n = 8192
    a = torch.empty(n, n, device="meta", dtype=torch.bfloat16)
    h100 = get_device("h100")
    cost = measure_cost(lambda: a @ a, h100)
    flops = 2 * n**3
    assert cost.flops == flops
    compute = flops / (989e12 * h100.compute_efficiency)
    memory = 3 * n * n * 2 / (h100.memory_bandwidth * h100.memory_efficiency)
    assert compute > 5 * memory
    assert cost.time_s == pytest.approx(compute + h100.op_overhead_s, rel=1e-12)


def test_roofline_elementwise_is_memory_bound():
    n = 2**24
    a = torch.empty(n, device="meta")
    h100 = get_device("h100")
    cost = measure_cost(lambda: a + a, h100)
    expected = 3 * 4 * n / (3350e9 * h100.memory_efficiency) + 5e-6
    assert cost.time_s == pytest.approx(expected, rel=1e-12)


def test_inference_mode_still_counts_linear_flops():
    # Under inference_mode aten.linear reaches the mode undecomposed.
    layer, x = nn.Linear(8, 4), torch.randn(3, 8)
    with torch.inference_mode():
        cost = measure_cost(lambda: layer(x))
    assert cost.flops == 2 * 3 * 8 * 4


def test_unknown_dtype_override_is_refused():
    with pytest.raises(ValueError, match="unknown dtype 'int4'"):
        OpCostMode(dtype_override="int4")
