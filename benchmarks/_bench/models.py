"""The model the demo and the GPU check train: a GPT-like decoder (optionally a top-1 mixture of
experts), its synthetic tokens, and one training step.

Everything a checkpoint must restore for training to continue bit for bit is state here: the
model's parameters and its ``tokens_seen`` buffer (which changes in ``forward``, outside the
optimizer step: a checkpoint must copy it at save time), the optimizer, the data position, and the
RNG (each step draws from it; see :func:`train_step`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class ModelSpec:
    """A model's shape and its batch. ``experts > 0`` makes every MLP a top-1 mixture of experts."""

    name: str = "GPT"
    vocab: int = 2048
    d: int = 192
    layers: int = 4
    heads: int = 4
    seq: int = 128
    batch: int = 16
    dropout: float = 0.0
    experts: int = 0


class _Experts(nn.Module):
    """A top-1 mixture of MLP experts: each token goes to the expert its router scores highest."""

    def __init__(self, d: int, experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                                     for _ in range(experts))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        weight, choice = self.router(h).softmax(-1).max(-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            sel = choice == e
            if sel.any():
                out[sel] = (expert(h[sel]) * weight[sel].unsqueeze(-1)).to(out.dtype)
        return out


class _Block(nn.Module):
    def __init__(self, s: ModelSpec, fast: bool) -> None:
        super().__init__()
        self.heads, self.fast = s.heads, fast
        self.ln1, self.ln2 = nn.LayerNorm(s.d), nn.LayerNorm(s.d)
        self.qkv, self.proj = nn.Linear(s.d, 3 * s.d), nn.Linear(s.d, s.d)
        self.mlp: nn.Module = (_Experts(s.d, s.experts) if s.experts else
                               nn.Sequential(nn.Linear(s.d, 4 * s.d), nn.GELU(), nn.Linear(4 * s.d, s.d)))
        self.drop = nn.Dropout(s.dropout)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.fast:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # plain ops: deterministic under torch.use_deterministic_algorithms
            att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            y = att.masked_fill(mask, float("-inf")).softmax(-1) @ v
        return self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attend(self.ln1(x))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """A GPT-like decoder. ``fast``: fused attention; otherwise plain ops that are deterministic
    (what a bit-for-bit comparison of two runs on a GPU needs)."""

    def __init__(self, s: ModelSpec, fast: bool = True) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(s.vocab, s.d), nn.Embedding(s.seq, s.d)
        self.blocks = nn.ModuleList(_Block(s, fast) for _ in range(s.layers))
        self.ln, self.head = nn.LayerNorm(s.d), nn.Linear(s.d, s.vocab, bias=False)
        self.register_buffer("tokens_seen", torch.zeros((), dtype=torch.int64))  # changes in forward

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        if self.training:
            cast(torch.Tensor, self.tokens_seen).add_(idx.numel())
        return self.head(self.ln(x))


class Tokens:
    """Batches of random tokens, reproducible from (seed, position); the position is its state."""

    def __init__(self, s: ModelSpec, device: torch.device | str = "cpu", seed: int = 1234) -> None:
        self.s, self.device, self.seed, self.position = s, torch.device(device), seed, 0

    def next(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.position)
        self.position += 1
        return torch.randint(0, self.s.vocab, (self.s.batch, self.s.seq + 1), generator=g).to(self.device)

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


def build(s: ModelSpec, device: torch.device | str = "cpu", *, fast: bool = True,
          seed: int = 0) -> tuple[GPT, torch.optim.Optimizer, Tokens]:
    """The model (seeded), its AdamW optimizer (fused on CUDA) and its data."""
    device = torch.device(device)
    torch.manual_seed(seed)
    with device:
        model = GPT(s, fast)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=device.type == "cuda")
    return model, opt, Tokens(s, device)


def train_step(model: GPT, opt: torch.optim.Optimizer, data: Tokens, accum: int = 1) -> float:
    """One optimizer step over ``accum`` micro-batches (bf16 autocast on CUDA); returns the loss a
    training loop logs, plus a 1e-9-scale draw from the CPU RNG, so that a wrongly restored RNG
    shows in the logged loss (synchronizes with the GPU)."""
    device = next(model.parameters()).device
    total = torch.zeros((), device=device)
    for _ in range(accum):
        batch = data.next()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)) / accum
        loss.backward()
        total += loss.detach()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(total) + float(torch.randn(())) * 1e-9


def params_and_state_bytes(model: nn.Module) -> tuple[int, int]:
    """Parameters, and the bytes of a checkpoint of the model with AdamW: fp32 parameters and two
    fp32 moments each (works on the meta device: sizes only)."""
    n = sum(p.numel() for p in model.parameters())
    return n, n * 4 * 3
