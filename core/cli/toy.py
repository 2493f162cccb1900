"""A small GPT-like model for the demo, the tests and the benchmark.

``attention="math"`` spells attention out (deterministic everywhere, so graphed runs can
be compared bit for bit with eager ones); ``"sdpa"`` uses
``torch.nn.functional.scaled_dot_product_attention`` (fast, memory-lean, for benchmarks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "Block", "TinyGPT"]


@dataclass
class GPTConfig:
    hidden: int = 64
    heads: int = 4
    ffn: int = 256
    seq: int = 32
    batch: int = 2
    layers: int = 4
    vocab: int = 128
    attention: str = "math"
    dtype: torch.dtype = torch.float32


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP, with residuals."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        if c.hidden % c.heads:
            raise ValueError(f"hidden {c.hidden} is not divisible by heads {c.heads}")
        self.heads, self.attention = c.heads, c.attention
        self.ln1 = nn.LayerNorm(c.hidden)
        self.qkv = nn.Linear(c.hidden, 3 * c.hidden)
        self.proj = nn.Linear(c.hidden, c.hidden)
        self.ln2 = nn.LayerNorm(c.hidden)
        self.fc1 = nn.Linear(c.hidden, c.ffn)
        self.fc2 = nn.Linear(c.ffn, c.hidden)
        if c.attention == "math":
            self.register_buffer("mask", torch.ones(c.seq, c.seq, dtype=torch.bool).triu(1),
                                 persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        d = h // self.heads
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d).permute(2, 0, 3, 1, 4)
        if self.attention == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
            mask = cast(torch.Tensor, self.mask)  # a registered buffer
            att = att.masked_fill(mask[:s, :s], float("-inf")).softmax(-1)
            o = att @ v
        x = x + self.proj(o.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    """Embedding, a stack of :class:`Block`, final norm and LM head.

    ``blocks`` is a plain ``nn.ModuleList`` so it can be wrapped (e.g. by
    :class:`graphslot.adapters.torch.GraphedLayers`) and assigned to ``stack``.
    """

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.config = c
        self.embed = nn.Embedding(c.vocab, c.hidden)
        self.pos = nn.Parameter(torch.randn(c.seq, c.hidden) * 0.02)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.stack: nn.Module = nn.Sequential(*self.blocks)
        self.ln_f = nn.LayerNorm(c.hidden)
        self.head = nn.Linear(c.hidden, c.vocab)

    def hidden_in(self, tokens: torch.Tensor) -> torch.Tensor:
        """The input the block stack sees."""
        return self.embed(tokens) + self.pos[: tokens.shape[1]]

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.ln_f(self.stack(self.hidden_in(tokens))))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def batch(self, step: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """A deterministic batch of tokens and next-token targets for ``step``."""
        c = self.config
        g = torch.Generator().manual_seed(1000 + step)
        t = torch.randint(0, c.vocab, (c.batch, c.seq + 1), generator=g)
        return t[:, :-1].to(device), t[:, 1:].to(device)
