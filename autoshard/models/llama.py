"""A hand-written Llama-3-shaped decoder whose ``forward`` returns the training loss.

The module layout (names follow Meta's reference implementation and torchtitan; sharding plans refer to them)::

    embed                        token embedding (V, D)
    layers[i].attention_norm     RMSNorm before attention
    layers[i].attention.wq       query projection (D -> n_head * head_dim), no bias
    layers[i].attention.wk/wv    key/value projections (D -> n_kv_head * head_dim), no bias
    layers[i].attention.wo       output projection (n_head * head_dim -> D), no bias
    layers[i].ffn_norm           RMSNorm before the feed-forward
    layers[i].feed_forward.w1/w3 SwiGLU gate and up projections (D -> ffn), no bias
    layers[i].feed_forward.w2    SwiGLU down projection (ffn -> D), no bias
    norm                         final RMSNorm
    output                       LM head (D -> V), not tied to ``embed``

Rotary position embeddings use the "rotate half" convention with real arithmetic (no complex tensors): the
head dimension is split into two halves (x1, x2) and rotated as (x1 cos - x2 sin, x1 sin + x2 cos). The
cos/sin tables are non-persistent buffers ``rope_cos``/``rope_sin`` of shape (seq_len, head_dim // 2), so
``state_dict`` holds parameters only. On the meta device they are meta tensors like everything else (the
planner only needs their shapes); after ``to_empty`` call :meth:`Llama.init_weights` to fill them.

Grouped-query attention repeats each key/value head ``n_head // n_kv_head`` times before a causal
``F.scaled_dot_product_attention``. There is no dropout and no KV cache. Initialisation draws from torch's
default RNG: seed it (``torch.manual_seed``) before constructing to get identical models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autoshard.errors import InputError
from autoshard.models.tokens import next_token_batch

__all__ = [
    "Attention",
    "FeedForward",
    "Llama",
    "LlamaConfig",
    "RMSNorm",
    "TransformerBlock",
    "apply_rotary",
    "llama_example_inputs",
    "rope_tables",
]


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a :class:`Llama`. ``head_dim = d_model // n_head``; ``n_head`` must be a multiple of
    ``n_kv_head`` (each key/value head serves ``n_head // n_kv_head`` query heads)."""

    n_layer: int = 2
    d_model: int = 256
    n_head: int = 8
    n_kv_head: int = 4
    ffn: int = 512
    vocab: int = 1024
    seq_len: int = 128
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.d_model % self.n_head != 0:
            raise InputError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if self.n_kv_head <= 0 or self.n_head % self.n_kv_head != 0:
            raise InputError(
                f"n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}; "
                "grouped-query attention needs every key/value head to serve the same number of query heads"
            )
        if self.head_dim % 2 != 0:
            raise InputError(f"head_dim={self.head_dim} (d_model // n_head) must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @classmethod
    def llama3_8b(cls, seq_len: int = 2048) -> LlamaConfig:
        """Llama-3 8B: 32 layers, d_model 4096, 32 query / 8 key-value heads, SwiGLU 14336, vocab 128256."""
        return cls(
            n_layer=32,
            d_model=4096,
            n_head=32,
            n_kv_head=8,
            ffn=14336,
            vocab=128256,
            seq_len=seq_len,
            rope_theta=500000.0,
            norm_eps=1e-5,
        )

    @classmethod
    def llama3_70b(cls, seq_len: int = 8192) -> LlamaConfig:
        """Llama-3 70B (Meta, "The Llama 3 Herd of Models", 2024, table 3): 80 layers, d_model 8192,
        64 query / 8 key-value heads, SwiGLU 28672, vocab 128256."""
        return cls(
            n_layer=80,
            d_model=8192,
            n_head=64,
            n_kv_head=8,
            ffn=28672,
            vocab=128256,
            seq_len=seq_len,
            rope_theta=500000.0,
            norm_eps=1e-5,
        )

    @classmethod
    def llama3_405b(cls, seq_len: int = 8192) -> LlamaConfig:
        """Llama-3 405B (Meta, "The Llama 3 Herd of Models", 2024, table 3): 126 layers, d_model 16384,
        128 query / 8 key-value heads, SwiGLU 53248, vocab 128256."""
        return cls(
            n_layer=126,
            d_model=16384,
            n_head=128,
            n_kv_head=8,
            ffn=53248,
            vocab=128256,
            seq_len=seq_len,
            rope_theta=500000.0,
            norm_eps=1e-5,
        )


def rope_tables(
    seq_len: int, head_dim: int, theta: float, device: torch.device | str | None = None
) -> tuple[Tensor, Tensor]:
    """(cos, sin), each (seq_len, head_dim // 2) float32: angle[t, i] = t * theta^(-2i / head_dim)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` (..., T, head_dim) by position: halves (x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos).

    ``cos``/``sin`` are (T, head_dim // 2) and broadcast over the leading dims; the result has x's dtype."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim, computed in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary q/k and bias-free projections."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.n_kv_head = cfg.n_kv_head
        self.head_dim = cfg.head_dim
        d, hd = cfg.d_model, cfg.head_dim
        self.wq = nn.Linear(d, cfg.n_head * hd, bias=False)
        self.wk = nn.Linear(d, cfg.n_kv_head * hd, bias=False)
        self.wv = nn.Linear(d, cfg.n_kv_head * hd, bias=False)
        self.wo = nn.Linear(cfg.n_head * hd, d, bias=False)

    def _repeat_kv(self, x: Tensor) -> Tensor:
        """(B, n_kv, T, hd) -> (B, n_head, T, hd): key/value head j serves query heads j*rep .. j*rep+rep-1."""
        rep = self.n_head // self.n_kv_head
        if rep == 1:
            return x
        b, h, t, hd = x.shape
        return x[:, :, None].expand(b, h, rep, t, hd).reshape(b, h * rep, t, hd)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, self._repeat_kv(k), self._repeat_kv(v), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, self.n_head * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.ffn, bias=False)
        self.w2 = nn.Linear(cfg.ffn, cfg.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attention(attention_norm(x))``, then ``+ feed_forward(ffn_norm(.))``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Llama-3-shaped decoder; ``forward(tokens, targets)`` returns the mean next-token cross-entropy."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        # Non-persistent: derived from the config, not learned. On meta these are shapes only, which is all
        # the planner reads; init_weights() recomputes them on a real device.
        half = cfg.head_dim // 2
        self.register_buffer("rope_cos", torch.empty(cfg.seq_len, half), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.seq_len, half), persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """N(0, 0.02) weights, residual projections scaled by 1/sqrt(2 n_layer), unit norms, fresh rope tables.

        A no-op on the meta device (nothing to fill); call it after ``to_empty(device=...)``."""
        if self.embed.weight.device.type == "meta":
            return
        resid_std = 0.02 / (2 * max(self.cfg.n_layer, 1)) ** 0.5
        for name, mod in self.named_modules():
            if isinstance(mod, nn.Linear):
                std = resid_std if name.endswith(("attention.wo", "feed_forward.w2")) else 0.02
                nn.init.normal_(mod.weight, mean=0.0, std=std)
            elif isinstance(mod, nn.Embedding):
                nn.init.normal_(mod.weight, mean=0.0, std=0.02)
            elif isinstance(mod, RMSNorm):
                nn.init.ones_(mod.weight)
        cos, sin = rope_tables(self.cfg.seq_len, self.cfg.head_dim, self.cfg.rope_theta, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        _, t = tokens.shape
        if t > self.cfg.seq_len:
            raise InputError(f"sequence length {t} exceeds cfg.seq_len={self.cfg.seq_len}")
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def llama_example_inputs(cfg: LlamaConfig, batch: int, seq: int | None = None, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Random ``(tokens, targets)`` for this config (see ``next_token_batch``)."""
    return next_token_batch(cfg.vocab, cfg.seq_len, batch, seq, seed)
