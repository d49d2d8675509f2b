"""A Llama-shaped decoder built on the meta device (no weights), and its planning benchmark case.

``python -m bench._llama --solver highs`` plans it once (``end_to_end``); bench_scaling
``--llama70b`` runs that in a process of its own per solver.

RMSNorm, rotary position embeddings, grouped-query attention (the key/value heads
repeated to the query heads, then causal ``scaled_dot_product_attention``),
SwiGLU MLP, an untied LM head: the structure of Llama 2 / 3. ``LLAMA_70B`` is
Llama 3 70B's shape (80 layers, width 8192, 64 heads, 8 key/value heads, FFN
28672, vocabulary 128256, context 4096): 70.6 B parameters.

Example::

    with torch.device("meta"):
        model = Llama(LLAMA_70B)
    ids, targets = token_batch(LLAMA_70B, 2)   # on meta too under torch.device("meta")
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent

__all__ = ["LLAMA_70B", "Llama", "LlamaConfig", "end_to_end", "loss_fn", "token_batch"]


@dataclass(frozen=True)
class LlamaConfig:
    layers: int
    dim: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    rope_theta: float = 500000.0

    def __post_init__(self) -> None:
        if self.dim % self.heads or self.heads % self.kv_heads:
            raise ValueError(
                f"dim ({self.dim}) must be a multiple of heads ({self.heads}), and heads of "
                f"kv_heads ({self.kv_heads})"
            )


LLAMA_70B = LlamaConfig(
    layers=80, dim=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256, seq=4096
)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + turned * sin


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.c = c
        hd = c.dim // c.heads
        self.q_proj = nn.Linear(c.dim, c.heads * hd, bias=False)
        self.k_proj = nn.Linear(c.dim, c.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(c.dim, c.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(c.heads * hd, c.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        c = self.c
        hd = c.dim // c.heads
        q = self.q_proj(x).view(b, t, c.heads, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.kv_heads, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.kv_heads, hd).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        rep = c.heads // c.kv_heads
        k, v = (z.repeat_interleave(rep, dim=1) for z in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, c.dim))


class MLP(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.dim, c.ffn, bias=False)
        self.up_proj = nn.Linear(c.dim, c.ffn, bias=False)
        self.down_proj = nn.Linear(c.ffn, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.dim)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.dim)
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """Token ids (B, T) int64 -> logits (B, T, vocab)."""

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.dim)
        self.lm_head = nn.Linear(c.dim, c.vocab, bias=False)
        hd = c.dim // c.heads
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        angles = torch.outer(torch.arange(c.seq, dtype=torch.float32), inv)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def token_batch(c: LlamaConfig, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, next tokens), each (batch_size, seq) int64, on torch's default device."""
    ids = torch.randint(0, c.vocab, (batch_size, c.seq + 1))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over all (B·T) positions."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


# --------------------------------------------------------------------------- the benchmark case


def end_to_end(
    solver: str, limit_s: float, devices: int = 1024, global_batch: int = 1024
) -> dict[str, Any]:
    """``plan_model`` of Llama 70B (meta device) on H100s in nodes of 8, analytic profile.

    Profiling (capture included) and search timed apart; the peak resident
    memory of this process (``resource.getrusage``: run one case per process for
    a figure of its own). The profile cache is off: a cold profile every time.
    """
    import planner.planning as api
    import planner.profile.sizes as sizes
    from bench.bench_scaling import timed
    from planner.devices import from_gpus
    from planner.options import ProfileOptions, SearchOptions, Training

    t0 = time.perf_counter()
    with torch.device("meta"):
        model = Llama(LLAMA_70B)
    build_s = time.perf_counter() - t0

    def sampler(b: int) -> Any:
        with torch.device("meta"):
            ids, targets = token_batch(LLAMA_70B, b)
        return (ids,), {}, targets

    options = api.PlanOptions(
        training=Training(global_batch=global_batch, precision="bf16-mixed"),
        search=SearchOptions(solver=solver, time_limit_s=limit_s),
        profile=ProfileOptions(cache=False),
    )
    out: dict[str, Any] = {
        "model": "llama 70B shape (80 layers, dim 8192, 64/8 heads, ffn 28672, vocab 128256, "
        "seq 4096), meta device",
        "parameters": sum(p.numel() for p in model.parameters()),
        "global_batch": global_batch,
        "devices": devices,
        "solver": solver,
        "build_s": build_s,
    }
    with timed(sizes, "profile_model") as prof, timed(api, "search") as srch:
        t0 = time.perf_counter()
        try:
            plan = api.plan_model(
                model, sampler, cluster=from_gpus(devices, "h100"), loss_fn=loss_fn, options=options
            )
        except Exception as exc:  # a failed search is a result too: say where and why
            plan = None
            out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        out["total_s"] = time.perf_counter() - t0
    out.update(profiles=len(prof.calls), profile_s=prof.seconds, search_s=srch.seconds)
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if plan is not None:
        out["blocks"] = plan.model.blocks
        out["chosen"] = f"pp {plan.pp} × dp {plan.dp}, m {plan.micro_batches}, {plan.schedule}"
        out["step_ms"] = plan.predicted.step_ms
        out["solver_status"] = plan.solver.status
    out["load_avg"] = os.getloadavg()
    return out


def llama_end_to_end(solver: str, limit_s: float, timeout_s: float) -> dict[str, Any]:
    """bench._llama.end_to_end in a process of its own (its peak RSS is the case's alone)."""
    cmd = [sys.executable, "-m", "bench._llama", "--solver", solver, "--limit", str(limit_s)]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return {"model": "llama 70B shape", "devices": 1024, "solver": solver,
                "error": f"timed out after {timeout_s:.0f} s (--timeout)"}  # fmt: skip
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return dict(json.loads(lines[-1]))


def main(argv: list[str] | None = None) -> int:
    """One case in this process, its record as the last line of stdout (JSON)."""
    ap = argparse.ArgumentParser(description="Llama 70B on 1024 H100s, end to end")
    ap.add_argument("--solver", default="highs")
    ap.add_argument("--limit", type=float, default=60.0)
    ns = ap.parse_args(argv)
    print(json.dumps(end_to_end(ns.solver, ns.limit), default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
