"""A small hand-written GPT whose ``forward`` returns the training loss.

The module layout (names matter: sharding plans and tests refer to them)::

    wte                      token embedding (V, D), tied to the LM head
    wpe                      learned positional embedding (seq_len, D)
    layers[i].ln1            pre-attention LayerNorm
    layers[i].attn.wq/wk/wv  query/key/value projections (D -> D)
    layers[i].attn.wo        output projection (D -> D)
    layers[i].ln2            pre-MLP LayerNorm
    layers[i].mlp.fc1/fc2    MLP (D -> mlp_ratio*D -> D), exact GELU
    ln_f                     final LayerNorm

There is no dropout, and the logits are ``F.linear(x, wte.weight)``.
Initialisation draws from torch's default RNG: seed it (``torch.manual_seed``)
before constructing to get identical models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autoshard.errors import InputError
from autoshard.models.tokens import next_token_batch

__all__ = ["GPTConfig", "GPT", "Block", "CausalSelfAttention", "FeedForward", "gpt_example_inputs"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`GPT`.

    ``bias=True`` gives every Linear and LayerNorm a bias. Note that ``attn.wk.bias`` has a
    mathematically zero gradient (softmax ignores a per-query constant), so with Adam its
    value after a step is rounding noise: prefer ``bias=False`` when comparing trajectories.
    """

    n_layer: int = 4
    d_model: int = 256
    n_head: int = 8
    vocab: int = 1024
    seq_len: int = 128
    mlp_ratio: int = 4
    bias: bool = True

    def __post_init__(self) -> None:
        if self.d_model % self.n_head != 0:
            raise InputError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @classmethod
    def gpt2_124m(cls, seq_len: int = 1024) -> GPTConfig:
        """GPT-2 small (Radford et al. 2019): 12 layers, d_model 768, 12 heads, vocab 50257, 1024 positions."""
        return cls(n_layer=12, d_model=768, n_head=12, vocab=50257, seq_len=seq_len, mlp_ratio=4, bias=True)

    @classmethod
    def gpt2_1_5b(cls, seq_len: int = 1024) -> GPTConfig:
        """GPT-2 XL (Radford et al. 2019): 48 layers, d_model 1600, 25 heads, vocab 50257, 1024 positions."""
        return cls(n_layer=48, d_model=1600, n_head=25, vocab=50257, seq_len=seq_len, mlp_ratio=4, bias=True)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q/k/v/o projections."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_head = cfg.n_head
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(d, d, bias=cfg.bias)
        self.wk = nn.Linear(d, d, bias=cfg.bias)
        self.wv = nn.Linear(d, d, bias=cfg.bias)
        self.wo = nn.Linear(d, d, bias=cfg.bias)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q = self.wq(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, d)
        return self.wo(y)


class FeedForward(nn.Module):
    """Two-layer MLP with exact (erf) GELU."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.d_model
        self.fc1 = nn.Linear(cfg.d_model, hidden, bias=cfg.bias)
        self.fc2 = nn.Linear(hidden, cfg.d_model, bias=cfg.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = FeedForward(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(tokens, targets)`` returns the mean cross-entropy."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 style init: N(0, 0.02) weights, zero biases, scaled residual projections."""
        resid_std = 0.02 / (2 * max(self.cfg.n_layer, 1)) ** 0.5
        for name, mod in self.named_modules():
            if isinstance(mod, nn.Linear):
                std = resid_std if name.endswith(("attn.wo", "mlp.fc2")) else 0.02
                nn.init.normal_(mod.weight, mean=0.0, std=std)
                if mod.bias is not None:
                    nn.init.zeros_(mod.bias)
            elif isinstance(mod, nn.Embedding):
                nn.init.normal_(mod.weight, mean=0.0, std=0.02)
            elif isinstance(mod, nn.LayerNorm):
                mod.reset_parameters()

    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        _, t = tokens.shape
        if t > self.cfg.seq_len:
            raise InputError(f"sequence length {t} exceeds cfg.seq_len={self.cfg.seq_len}")
        pos = torch.arange(t, device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)
        for layer in self.layers:
            x = layer(x)
        x = self.ln_f(x)
        logits = F.linear(x, self.wte.weight)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def gpt_example_inputs(cfg: GPTConfig, batch: int, seq: int | None = None, *, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Random ``(tokens, targets)`` for this config (see ``next_token_batch``)."""
    return next_token_batch(cfg.vocab, cfg.seq_len, batch, seq, seed)
