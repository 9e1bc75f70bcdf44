"""The model fuzzer's models: the :class:`FuzzModel` of a :class:`~autoshard.testing.fuzz_cases.FuzzCase`, its
weights and its inputs, drawn from the case alone.

Every block is one of the ops users train (:class:`FuzzBlock`) or a block that draws random numbers in training
(:class:`RandomBlock`: a dropout, a sampled router). Weights come from torch's generator seeded by the case
(:func:`build_model`, the caller's generator untouched), index tensors and masks from a Python stream of the case,
and a random block's weights from a stream of its own, so that inserting one changes no other block's values.
"""

from __future__ import annotations

import math
import random
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autoshard.testing.fuzz_cases import RANDOM_BLOCKS, Block, FuzzCase


class SmoothSquare(torch.autograd.Function):
    """``x * tanh(x)`` with its derivative written out: a user's custom ``autograd.Function``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return x * torch.tanh(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        t = torch.tanh(x)
        return grad * (t + x * (1 - t * t))


class FuzzBlock(nn.Module):
    """One :class:`Block` on a ``(batch, seq, features)`` activation. Index tensors and masks are buffers drawn
    from ``rng`` (a fixed pattern per case); weights come from torch's seeded generator."""

    def __init__(self, block: Block, width: int, seq: int, rng: random.Random) -> None:
        super().__init__()
        self.kind, self.variant, self.arg, self.width = block.kind, block.variant, block.arg, block.width
        w, k = block.width, block.kind
        if k == "linear":
            self.lin = nn.Linear(width, w)
        elif k in ("matmul", "einsum"):
            self.w = nn.Parameter(torch.randn(width, w) / math.sqrt(width))
        elif k == "conv":
            self.conv = nn.Conv1d(width, w, block.arg, padding=block.arg // 2)
        elif k in ("layernorm", "rmsnorm", "batchnorm", "groupnorm"):
            self.norm = {
                "layernorm": lambda: nn.LayerNorm(width),
                "rmsnorm": lambda: nn.RMSNorm(width),
                "batchnorm": lambda: nn.BatchNorm1d(width),
                "groupnorm": lambda: nn.GroupNorm(block.arg, width),
            }[k]()
        elif k == "attention":
            self.head_dim = rng.choice((2, 3, 4, 8))
            self.qkv = nn.Linear(width, 3 * block.arg * self.head_dim, bias=False)
            self.proj = nn.Linear(block.arg * self.head_dim, w)
            keep = torch.tensor([[j <= i or rng.random() < 0.3 for j in range(seq)] for i in range(seq)])
            self.register_buffer("mask", keep if block.variant == 2 else torch.where(keep, 0.0, -1.5))
        elif k in ("gather", "index", "scatter"):
            high, n = (w, width) if k == "scatter" else (seq, seq) if block.variant == 2 else (width, w)
            self.register_buffer("idx", torch.tensor([rng.randrange(high) for _ in range(n)]))
        elif k == "elementwise" and block.variant == 3:
            self.scale, self.shift = nn.Parameter(torch.randn(width)), nn.Parameter(torch.zeros(width))

    def forward(self, x: Tensor) -> Tensor:  # noqa: C901 - one branch per op family
        k, v = self.kind, self.variant
        b, s, d = x.shape
        if k == "linear":
            return F.gelu(self.lin(x))
        if k == "matmul":
            return torch.tanh(x @ self.w)
        if k == "einsum":
            return torch.einsum("bsd,de->bse", x, self.w)
        if k == "conv":
            y = self.conv(x.transpose(1, 2)).transpose(1, 2)
            return F.silu(y) if v else y
        if k in ("layernorm", "rmsnorm"):
            return self.norm(x)
        if k in ("batchnorm", "groupnorm"):
            return self.norm(x.transpose(1, 2)).transpose(1, 2)
        if k == "attention":
            q, kk, vv = self.qkv(x).view(b, s, 3, self.arg, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
            mask = None if v in (0, 1) else self.mask
            y = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, is_causal=v == 1)
            return self.proj(y.transpose(1, 2).reshape(b, s, -1))
        if k == "gather":
            return torch.gather(x, 2, self.idx.expand(b, s, -1))
        if k == "index":
            return (lambda: x[..., self.idx], lambda: torch.index_select(x, 2, self.idx), lambda: x[:, self.idx])[v]()
        if k == "scatter":
            zeros = x.new_zeros(b, s, self.width)
            return zeros.index_add(2, self.idx, x) if v else zeros.scatter_add(2, self.idx.expand(b, s, -1), x)
        if k == "reduce":
            return (
                lambda: x - x.mean(-1, keepdim=True),
                lambda: x * torch.softmax(x.amax(1, keepdim=True), -1),
                lambda: x / (x.abs().sum(0, keepdim=True) + 1),
                lambda: x - torch.logsumexp(x, -1, keepdim=True),
                lambda: torch.cumsum(x, 1) / s,
            )[v]()
        if k == "view":
            if v:
                return x.transpose(1, 2).reshape(b, s, d)
            return x.reshape(b, s, self.arg, d // self.arg).transpose(-1, -2).reshape(b, s, d)
        if k == "slice_cat":
            cut = self.arg % d
            return (
                lambda: torch.cat([x[..., cut:], x[..., :cut]], -1),
                lambda: torch.cat([x[:, 1:], x[:, :1]], 1),
                lambda: torch.cat([x, torch.tanh(x[..., : self.width - d])], -1),
            )[v]()
        if k == "elementwise":
            return (
                lambda: x * torch.sigmoid(x),
                lambda: torch.where(x > 0, x, 0.1 * x),
                lambda: x + 0.5 * x.pow(2).clamp(max=3.0),
                lambda: x * self.scale + self.shift,
            )[v]()
        return SmoothSquare.apply(x)


class RandomBlock(nn.Module):
    """A block that draws random numbers in training, keeping its width ``d``. ``dropout``: ``nn.Dropout`` (variant
    0) or ``F.dropout`` (1) with p = ``arg`` / 100. ``route``: a residual mixture of ``arg`` linear experts, each
    token sent to one (variants 0, 1) or two (2) of them by a router that samples in training, as MoE routers do:
    0 adds Gumbel noise drawn by ``exponential_()`` (Phimoe's sparsemixer), 1 jitters the router's input by
    ``rand_like`` (Switch), 2 adds ``randn_like`` noise of a learned scale and keeps the top 2 (noisy top-k)."""

    def __init__(self, block: Block, rng: random.Random) -> None:
        super().__init__()
        self.kind, self.variant, d = block.kind, block.variant, block.width
        self.p = block.arg / 100
        self.drop = nn.Dropout(self.p) if self.kind == "dropout" and self.variant == 0 else None
        if self.kind == "route":
            g = torch.Generator().manual_seed(rng.randrange(2**31))
            e = block.arg
            self.router = nn.Parameter(torch.randn(d, e, generator=g) / math.sqrt(d))
            self.experts = nn.Parameter(torch.randn(e, d, d, generator=g) / math.sqrt(d))
            self.noise = nn.Parameter(torch.randn(d, e, generator=g) / math.sqrt(d)) if self.variant == 2 else None

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "dropout":
            return self.drop(x) if self.drop is not None else F.dropout(x, self.p, self.training)
        v, sample, f32 = self.variant, self.training, torch.float32  # (fp32 draws: a float64 copy draws the same)
        if v == 1 and sample:
            x_in = x * (1 + 0.2 * (2 * torch.rand_like(x, dtype=f32).to(x.dtype) - 1))
        else:
            x_in = x
        s = x_in @ self.router
        if v == 2:
            noisy = s + torch.randn_like(s, dtype=f32).to(s.dtype) * F.softplus(x @ self.noise) if sample else s
            vals, idx = noisy.topk(min(2, s.shape[-1]), -1)
            gates = torch.zeros_like(s).scatter(-1, idx, torch.softmax(vals, -1))
        else:
            pick = s - torch.empty_like(s, dtype=f32).exponential_().log().to(s.dtype) if v == 0 and sample else s
            idx = pick.argmax(-1, keepdim=True)
            gates = torch.zeros_like(s).scatter(-1, idx, torch.softmax(s, -1).gather(-1, idx))
        y = torch.einsum("bsd,edf->bsef", x, self.experts)
        return x + torch.einsum("bse,bsef->bsf", gates, y)


class FuzzModel(nn.Module):
    """The model of a :class:`FuzzCase`: an embedding (token inputs) or float features, its blocks in order, an
    output layer and the case's scalar loss; ``forward(x[, target]) -> loss``."""

    def __init__(self, case: FuzzCase) -> None:
        super().__init__()
        rng = random.Random(f"autoshard-fuzz-buffers/{case.seed}/{case.index}")
        self.loss = case.loss
        self.embed = nn.Embedding(case.vocab, case.width) if case.vocab else None
        widths = [case.width] + [b.width for b in case.blocks]
        own = random.Random(f"autoshard-fuzz-random-init/{case.seed}/{case.index}")  # (random blocks' weights)
        self.blocks = nn.ModuleList(
            RandomBlock(b, own) if b.kind in RANDOM_BLOCKS else FuzzBlock(b, widths[i], case.seq, rng)
            for i, b in enumerate(case.blocks)
        )
        last = widths[-1] + widths[-1] % 2 if case.experts else widths[-1]  # (the MoE layer wants an even width)
        self.to_moe = nn.Linear(widths[-1], last) if last != widths[-1] else None
        self.moe = _experts(last, case) if case.experts else None
        self.head = nn.Linear(last, case.out)

    def forward(self, x: Tensor, target: Tensor | None = None) -> Tensor:
        h = self.embed(x) if self.embed is not None else x
        for block in self.blocks:
            h = block(h)
        aux = 0.0
        if self.moe is not None:
            h = self.to_moe(h) if self.to_moe is not None else h
            mixed, aux = self.moe(h)
            h, aux = h + mixed, 0.01 * aux
        y = self.head(h)
        if self.loss == "mse":
            return F.mse_loss(y, target) + aux
        if self.loss == "cross_entropy":
            return F.cross_entropy(y.reshape(-1, y.shape[-1]), target.reshape(-1)) + aux
        return y.pow(2).mean() + aux


def _experts(width: int, case: FuzzCase) -> nn.Module:
    """A top-2 (top-1 of one expert) mixture of ``case.experts`` SwiGLU experts of hidden size 6 over ``width``."""
    from autoshard.models.moe import MoEConfig, MoEFeedForward

    cfg = MoEConfig(
        n_layer=1,
        d_model=width,
        n_head=1,
        n_kv_head=1,
        ffn=6,
        n_experts=case.experts,
        top_k=min(2, case.experts),
        vocab=2,
        seq_len=case.seq,
    )
    moe = MoEFeedForward(cfg)
    for w in (moe.w1, moe.w3, moe.w2):
        nn.init.normal_(w, std=0.3)
    return moe


def build_model(case: FuzzCase) -> FuzzModel:
    """The case's model, its weights drawn from a generator seeded by the case (the caller's RNG untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(case.seed * 100_003 + case.index)
        return FuzzModel(case)


def example_inputs(case: FuzzCase) -> tuple[Tensor, ...]:
    """The case's global batch: the tokens or features, then the target (none for the ``mean_square`` loss)."""
    g = torch.Generator().manual_seed(case.seed * 7919 + case.index)
    b, s = case.batch, case.seq
    x = torch.randint(case.vocab, (b, s), generator=g) if case.vocab else torch.randn(b, s, case.width, generator=g)
    if case.loss == "mse":
        return x, torch.randn(b, s, case.out, generator=g)
    if case.loss == "cross_entropy":
        return x, torch.randint(case.out, (b, s), generator=g)
    return (x,)


__all__ = ["FuzzBlock", "FuzzModel", "RandomBlock", "SmoothSquare", "build_model", "example_inputs"]
