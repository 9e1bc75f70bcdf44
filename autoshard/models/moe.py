"""A Mixtral-shaped mixture-of-experts decoder whose ``forward`` returns the training loss.

Attention is the Llama one (grouped-query, rotary, bias-free: :class:`autoshard.models.llama.Attention`); the
feed-forward of every block is a sparse mixture of SwiGLU experts (Jiang et al. 2024, "Mixtral of Experts").
The module layout (sharding plans refer to these names)::

    embed                        token embedding (V, D)
    layers[i].attention_norm     RMSNorm before attention
    layers[i].attention.wq/wk/wv/wo   as in Llama
    layers[i].ffn_norm           RMSNorm before the experts
    layers[i].moe.router         Linear D -> E (no bias), the gate
    layers[i].moe.w1/w3          stacked expert gate/up weights, parameters of shape (E, D, ffn)
    layers[i].moe.w2             stacked expert down weights, (E, ffn, D)
    norm                         final RMSNorm
    output                       LM head (D -> V), not tied

Routing is GShard-style with a fixed capacity so that every shape is static (the planner traces the model
under FakeTensorMode: no boolean-mask indexing, ``nonzero`` or ``.item()``):

1. tokens are cut into groups of ``group_len`` consecutive tokens of one sequence;
2. router logits (in float32) -> softmax -> top-k; the k gate values are renormalised to sum to one, as
   Mixtral does (softmax over all experts, keep the top k, divide by their sum);
3. each (token, choice) gets a slot in its expert's buffer by a cumulative sum over the group, every token's
   first choice ahead of any token's second choice; slots at or past ``capacity`` are dropped (that choice
   contributes nothing; the residual connection carries the token on);
4. ``dispatch``/``combine`` tensors of shape (groups, group_len, E, capacity) move tokens into the expert
   batch (E, groups * capacity, D) and back, with einsums; the experts run as ``torch.bmm`` over the stacked
   weights, so the expert dimension is an ordinary batch dimension a planner can shard (expert parallelism).

The loss adds ``aux_loss_coef`` times the Switch/GShard load-balancing loss ``E * sum_e f_e * P_e`` averaged
over layers, where ``f_e`` is the fraction of (token, choice) assignments routed to expert e before capacity
is applied and ``P_e`` the mean router probability of e (1.0 when perfectly balanced).
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autoshard.errors import InputError
from autoshard.models.llama import Attention, LlamaConfig, RMSNorm, rope_tables
from autoshard.models.tokens import next_token_batch

__all__ = ["MoEConfig", "MoEDecoder", "MoEFeedForward", "MoEBlock", "moe_example_inputs", "route"]


@dataclass(frozen=True)
class MoEConfig:
    """Shape of a :class:`MoEDecoder`. ``ffn`` is the hidden size of ONE expert; ``top_k`` experts of
    ``n_experts`` serve each token. ``group_size`` bounds the routing group (see :meth:`group_len`)."""

    n_layer: int = 2
    d_model: int = 256
    n_head: int = 8
    n_kv_head: int = 4
    ffn: int = 512
    n_experts: int = 8
    top_k: int = 2
    vocab: int = 1024
    seq_len: int = 128
    rope_theta: float = 1e6
    norm_eps: float = 1e-5
    capacity_factor: float = 1.25
    group_size: int = 512
    aux_loss_coef: float = 0.01

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.n_experts:
            raise InputError(f"top_k={self.top_k} must be between 1 and n_experts={self.n_experts}")
        if self.capacity_factor <= 0 or self.group_size < 1:
            raise InputError("capacity_factor must be positive and group_size at least 1")
        self.attention_config()  # validates heads, like LlamaConfig

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def attention_config(self) -> LlamaConfig:
        """The Llama config whose attention (and norms) these blocks reuse."""
        return LlamaConfig(
            n_layer=self.n_layer, d_model=self.d_model, n_head=self.n_head, n_kv_head=self.n_kv_head,
            ffn=self.ffn, vocab=self.vocab, seq_len=self.seq_len, rope_theta=self.rope_theta, norm_eps=self.norm_eps,
        )  # fmt: skip

    def group_len(self, seq: int) -> int:
        """Tokens per routing group: the largest divisor of ``seq`` that is at most ``group_size``, so groups
        never straddle two sequences and a batch-sharded input stays group-sharded."""
        return max(g for g in range(1, min(seq, self.group_size) + 1) if seq % g == 0)

    def capacity(self, group_len: int) -> int:
        """Slots per expert and group: ceil(capacity_factor * group_len * top_k / n_experts), at most
        ``group_len`` (an expert can receive each token of the group at most once)."""
        return min(group_len, math.ceil(self.capacity_factor * group_len * self.top_k / self.n_experts))

    @classmethod
    def mixtral_8x7b(cls, seq_len: int = 4096) -> MoEConfig:
        """Mixtral 8x7B (Jiang et al. 2024, table 1): 32 layers, d_model 4096, 32 query / 8 key-value heads,
        8 SwiGLU experts of 14336, top-2, vocab 32000, rope theta 1e6."""
        return cls(
            n_layer=32, d_model=4096, n_head=32, n_kv_head=8, ffn=14336, n_experts=8, top_k=2,
            vocab=32000, seq_len=seq_len, rope_theta=1e6, norm_eps=1e-5,
        )  # fmt: skip


def route(probs: Tensor, top_k: int, capacity: int) -> tuple[Tensor, Tensor, Tensor]:
    """GShard capacity routing of router probabilities ``probs`` (groups, group_len, E), float32.

    Returns ``(combine, dispatch, load)``: ``combine`` (groups, group_len, E, capacity) holds the renormalised
    gate of each kept (token, expert, slot), ``dispatch`` the same pattern as 0/1, and ``load`` (E,) the
    fraction of (token, choice) assignments each expert was asked for (before dropping; sums to 1).
    Only static shapes: masks come from comparisons with ``arange``, slots from ``cumsum``.
    """
    n, g, e = probs.shape
    gates, idx = probs.topk(top_k, dim=-1)  # (n, g, k)
    gates = gates / gates.sum(dim=-1, keepdim=True)
    experts = torch.arange(e, device=probs.device)
    mask = (idx.unsqueeze(-1) == experts).to(probs.dtype)  # (n, g, k, E)
    # Slot order: all first choices of the group, then all second choices, ... (choice-major cumsum).
    choice_major = mask.transpose(1, 2).reshape(n, top_k * g, e)
    pos = (torch.cumsum(choice_major, dim=1) - 1.0).reshape(n, top_k, g, e).transpose(1, 2)  # (n, g, k, E)
    keep = mask * (pos < capacity).to(probs.dtype)
    slots = torch.arange(capacity, device=probs.device, dtype=probs.dtype)
    # One (n, g, E, C) slot one-hot per choice, summed (a token's choices go to distinct experts); a loop over
    # the k choices rather than one (n, g, k, E, C) tensor keeps every tensor 4-D and k times smaller.
    placed = [keep[:, :, j, :, None] * (pos[:, :, j, :, None] == slots).to(probs.dtype) for j in range(top_k)]
    dispatch = functools.reduce(operator.add, placed)
    combine = functools.reduce(operator.add, (gates[:, :, j, None, None] * p for j, p in enumerate(placed)))
    load = mask.sum(dim=2).mean(dim=(0, 1)) / top_k
    return combine, dispatch, load


class MoEFeedForward(nn.Module):
    """Top-k mixture of SwiGLU experts with capacity dispatch; ``forward`` returns (output, aux_loss)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        e, d, f = cfg.n_experts, cfg.d_model, cfg.ffn
        self.router = nn.Linear(d, e, bias=False)
        self.w1 = nn.Parameter(torch.empty(e, d, f))
        self.w3 = nn.Parameter(torch.empty(e, d, f))
        self.w2 = nn.Parameter(torch.empty(e, f, d))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        b, t, d = x.shape
        cfg = self.cfg
        glen = cfg.group_len(t)
        cap = cfg.capacity(glen)
        xg = x.reshape(b * t // glen, glen, d)
        probs = F.softmax(self.router(xg).float(), dim=-1)
        combine, dispatch, load = route(probs, cfg.top_k, cap)
        groups, e = xg.shape[0], cfg.n_experts
        expert_in = torch.einsum("ngec,ngd->encd", dispatch.to(x.dtype), xg).reshape(e, groups * cap, d)
        h = F.silu(torch.bmm(expert_in, self.w1)) * torch.bmm(expert_in, self.w3)
        expert_out = torch.bmm(h, self.w2).reshape(e, groups, cap, d)
        y = torch.einsum("ngec,encd->ngd", combine.to(x.dtype), expert_out)
        aux = e * (load * probs.mean(dim=(0, 1))).sum()
        return y.reshape(b, t, d), aux


class MoEBlock(nn.Module):
    """Pre-norm block: ``x + attention(attention_norm(x))``, then ``+ moe(ffn_norm(.))``."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        acfg = cfg.attention_config()
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attention = Attention(acfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.moe = MoEFeedForward(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        y, aux = self.moe(self.ffn_norm(x))
        return x + y, aux


class MoEDecoder(nn.Module):
    """Mixtral-shaped decoder; ``forward(tokens, targets)`` returns next-token cross-entropy plus
    ``aux_loss_coef`` times the mean load-balancing loss of the layers."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.layers = nn.ModuleList(MoEBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        half = cfg.head_dim // 2
        self.register_buffer("rope_cos", torch.empty(cfg.seq_len, half), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.seq_len, half), persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """N(0, 0.02) weights (residual projections scaled by 1/sqrt(2 n_layer)), unit norms, rope tables.

        A no-op on the meta device; call it after ``to_empty(device=...)``."""
        if self.embed.weight.device.type == "meta":
            return
        resid_std = 0.02 / (2 * max(self.cfg.n_layer, 1)) ** 0.5
        for name, mod in self.named_modules():
            if isinstance(mod, nn.Linear):
                nn.init.normal_(mod.weight, std=resid_std if name.endswith("attention.wo") else 0.02)
            elif isinstance(mod, nn.Embedding):
                nn.init.normal_(mod.weight, std=0.02)
            elif isinstance(mod, RMSNorm):
                nn.init.ones_(mod.weight)
            elif isinstance(mod, MoEFeedForward):
                nn.init.normal_(mod.w1, std=0.02)
                nn.init.normal_(mod.w3, std=0.02)
                nn.init.normal_(mod.w2, std=resid_std)
        cos, sin = rope_tables(self.cfg.seq_len, self.cfg.head_dim, self.cfg.rope_theta, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        _, t = tokens.shape
        if t > self.cfg.seq_len:
            raise InputError(f"sequence length {t} exceeds cfg.seq_len={self.cfg.seq_len}")
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.embed(tokens)
        auxes = []
        for layer in self.layers:
            x, aux = layer(x, cos, sin)
            auxes.append(aux)
        logits = self.output(self.norm(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        if not auxes:
            return loss
        return loss + self.cfg.aux_loss_coef * torch.stack(auxes).mean().to(loss.dtype)


def moe_example_inputs(cfg: MoEConfig, batch: int, seq: int | None = None, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Random ``(tokens, targets)`` for this config (see ``next_token_batch``)."""
    return next_token_batch(cfg.vocab, cfg.seq_len, batch, seq, seed)
