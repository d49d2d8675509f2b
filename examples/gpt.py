"""A GPT-style decoder with a tied embedding and a large vocabulary: a model file for the planner.

Token embedding + learned position embedding, ``n_layers`` pre-norm transformer
blocks (LayerNorm → causal self-attention → residual; LayerNorm → 4× GELU MLP →
residual), a final LayerNorm and an LM head whose weight *is* the token
embedding's (tied). With a 16k vocabulary the embedding and head are the
heaviest stages, and the tied weight is shared by the first and last stage.

Knobs (keyword arguments of ``build_model``; their defaults come from the
environment, so ``GPT_LAYERS=48 planner plan examples/gpt.py`` grows the model):

``GPT_LAYERS`` / ``n_layers`` (default 6)   transformer blocks
``GPT_DIM`` / ``dim`` (default 256)         model width
``GPT_HEADS`` / ``n_heads`` (default 4)     attention heads (must divide the width)
``GPT_SEQ`` / ``seq_len`` (default 128)     context length; ``sample_batch`` reads it too
``GPT_VOCAB`` / ``vocab_size`` (default 16384)  vocabulary; ``sample_batch`` reads it too
``GPT_DROPOUT`` / ``dropout`` (default 0.0)  dropout probability
``GPT_BIAS`` / ``bias`` (default 1)          biases in Linear layers (0 or 1)

Change ``GPT_SEQ`` and ``GPT_VOCAB`` through the environment, not the keywords,
so that the sample batch matches the model.

Batches: ``idx`` (B, T) int64 token ids; targets (B, T) int64, the next token at
each position. ``forward(idx)`` returns logits (B, T, V).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

BATCH_SIZE = 8


def _env(name: str, default: int | float) -> int | float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return type(default)(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number; set it to e.g. {default}") from None


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 16384
    seq_len: int = 128
    dim: int = 256
    n_heads: int = 4
    n_layers: int = 6
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(
                f"dim ({self.dim}) must be a multiple of n_heads ({self.n_heads}); "
                "change GPT_DIM or GPT_HEADS"
            )
        if min(self.vocab_size, self.seq_len, self.dim, self.n_heads, self.n_layers) < 1:
            raise ValueError(f"every size must be positive, got {self}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.qkv = nn.Linear(config.dim, 3 * config.dim, bias=config.bias)
        self.proj = nn.Linear(config.dim, config.dim, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.config.n_heads
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        p = self.config.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.dim, 4 * config.dim, bias=config.bias)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * config.dim, config.dim, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.ln1 = nn.LayerNorm(config.dim, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.dim, bias=config.bias)
        self.mlp = MLP(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.dropout > 0:  # config-driven control flow: fine for torch.export
            x = x + self.drop(self.attn(self.ln1(x)))
            return x + self.drop(self.mlp(self.ln2(x)))
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.dim)
        self.pos_emb = nn.Embedding(config.seq_len, config.dim)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.dim, bias=config.bias)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: one Parameter, two modules
        self.apply(self._init)
        # GPT-2's scaled init of the residual projections keeps deep stacks stable.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * config.n_layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.config.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than seq_len={self.config.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        if self.config.dropout > 0:
            x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model(
    *,
    n_layers: int | None = None,
    dim: int | None = None,
    n_heads: int | None = None,
    seq_len: int | None = None,
    vocab_size: int | None = None,
    dropout: float | None = None,
    bias: bool | None = None,
) -> GPT:
    """The GPT; each keyword left out is read from its environment variable or default."""
    given = {
        "n_layers": n_layers,
        "dim": dim,
        "n_heads": n_heads,
        "seq_len": seq_len,
        "vocab_size": vocab_size,
        "dropout": dropout,
        "bias": bias,
    }
    env = {
        "n_layers": _env("GPT_LAYERS", 6),
        "dim": _env("GPT_DIM", 256),
        "n_heads": _env("GPT_HEADS", 4),
        "seq_len": _env("GPT_SEQ", 128),
        "vocab_size": _env("GPT_VOCAB", 16384),
        "dropout": _env("GPT_DROPOUT", 0.0),
        "bias": bool(_env("GPT_BIAS", 1)),
    }
    config = GPTConfig(**{k: env[k] if v is None else v for k, v in given.items()})
    return GPT(config)


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and their next tokens: new each step (torch's seed), RNG untouched."""
    gen = torch.Generator().manual_seed(torch.initial_seed())  # planner run: seed + step
    seq, vocab = int(_env("GPT_SEQ", 128)), int(_env("GPT_VOCAB", 16384))
    tokens = torch.randint(0, vocab, (batch_size, seq + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over all (B·T) positions."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
