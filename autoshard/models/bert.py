"""A BERT encoder with the masked-language-model loss (Devlin et al. 2019), ``forward`` returns the loss.

The module layout (sharding plans refer to these names)::

    word_embed                   token embedding (V, D), tied to the MLM decoder
    pos_embed                    learned positions (seq_len, D)
    type_embed                   token types / segments (type_vocab, D)
    embed_norm                   LayerNorm after the embedding sum
    layers[i].attn.wq/wk/wv/wo   bidirectional self-attention projections (D -> D, bias)
    layers[i].attn_norm          post-attention LayerNorm: LN(x + attn(x))
    layers[i].mlp.fc1/fc2        D -> ffn -> D, exact (erf) GELU
    layers[i].mlp_norm           post-MLP LayerNorm: LN(x + mlp(x))
    head_dense, head_norm        MLM transform: LN(gelu(dense(x)))
    head_bias                    MLM output bias (V); logits = transform(x) @ word_embed.weight.T + head_bias

There is no pooler (the next-sentence head is not trained here), no dropout and no attention mask: every
position attends to every other (a batch without padding). The loss is the cross-entropy over all positions
whose label is not -100 (``ignore_index``), as in BERT's masked-LM pre-training.

:class:`SelfAttention` and :class:`MLP` are shared with the ViT encoder (:mod:`autoshard.models.vit`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autoshard.errors import InputError

__all__ = ["MLP", "Bert", "BertConfig", "BertLayer", "SelfAttention", "bert_example_inputs", "init_encoder_weights"]


@dataclass(frozen=True)
class BertConfig:
    """Shape of a :class:`Bert`. ``seq_len`` is the number of learned positions (the longest input)."""

    n_layer: int = 2
    d_model: int = 256
    n_head: int = 8
    ffn: int = 1024
    vocab: int = 1024
    seq_len: int = 128
    type_vocab: int = 2
    norm_eps: float = 1e-12

    def __post_init__(self) -> None:
        if self.d_model % self.n_head != 0:
            raise InputError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")

    @classmethod
    def bert_large(cls, seq_len: int = 512) -> BertConfig:
        """BERT-Large (Devlin et al. 2019): 24 layers, d_model 1024, 16 heads, ffn 4096, WordPiece vocab
        30522, 512 positions, 2 token types."""
        return cls(n_layer=24, d_model=1024, n_head=16, ffn=4096, vocab=30522, seq_len=seq_len, type_vocab=2)


class SelfAttention(nn.Module):
    """Multi-head bidirectional (non-causal) self-attention with separate q/k/v/o projections."""

    def __init__(self, d_model: int, n_head: int, bias: bool = True) -> None:
        super().__init__()
        self.n_head = n_head
        self.wq = nn.Linear(d_model, d_model, bias=bias)
        self.wk = nn.Linear(d_model, d_model, bias=bias)
        self.wv = nn.Linear(d_model, d_model, bias=bias)
        self.wo = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        hd = d // self.n_head
        q = self.wq(x).view(b, t, self.n_head, hd).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_head, hd).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_head, hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    """``fc2(gelu(fc1(x)))`` with exact (erf) GELU."""

    def __init__(self, d_model: int, hidden: int, bias: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


@torch.no_grad()
def init_encoder_weights(model: nn.Module, std: float = 0.02) -> None:
    """BERT/ViT init: N(0, std) Linear and Embedding weights, zero biases, unit LayerNorms (no-op on meta)."""
    if any(p.device.type == "meta" for p in model.parameters()):
        return
    for mod in model.modules():
        if isinstance(mod, (nn.Linear, nn.Embedding)):
            nn.init.normal_(mod.weight, std=std)
            if getattr(mod, "bias", None) is not None:
                nn.init.zeros_(mod.bias)
        elif isinstance(mod, nn.LayerNorm):
            mod.reset_parameters()


class BertLayer(nn.Module):
    """Post-LayerNorm encoder layer: ``x = LN(x + attn(x)); x = LN(x + mlp(x))``."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.attn = SelfAttention(cfg.d_model, cfg.n_head)
        self.attn_norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = MLP(cfg.d_model, cfg.ffn)
        self.mlp_norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)

    def forward(self, x: Tensor) -> Tensor:
        x = self.attn_norm(x + self.attn(x))
        return self.mlp_norm(x + self.mlp(x))


class Bert(nn.Module):
    """BERT encoder + MLM head; ``forward(tokens, token_types, labels)`` returns the masked-LM loss."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.word_embed = nn.Embedding(cfg.vocab, d)
        self.pos_embed = nn.Embedding(cfg.seq_len, d)
        self.type_embed = nn.Embedding(cfg.type_vocab, d)
        self.embed_norm = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.n_layer))
        self.head_dense = nn.Linear(d, d)
        self.head_norm = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.head_bias = nn.Parameter(torch.zeros(cfg.vocab))
        init_encoder_weights(self)

    def forward(self, tokens: Tensor, token_types: Tensor, labels: Tensor) -> Tensor:
        _, t = tokens.shape
        if t > self.cfg.seq_len:
            raise InputError(f"sequence length {t} exceeds cfg.seq_len={self.cfg.seq_len}")
        pos = torch.arange(t, device=tokens.device)
        x = self.word_embed(tokens) + self.pos_embed(pos) + self.type_embed(token_types)
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x)
        h = self.head_norm(F.gelu(self.head_dense(x)))
        logits = F.linear(h, self.word_embed.weight, self.head_bias)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)


def bert_example_inputs(
    cfg: BertConfig, batch: int, seq: int | None = None, seed: int = 0, mask_prob: float = 0.15
) -> tuple[Tensor, Tensor, Tensor]:
    """Random masked-LM batch ``(tokens, token_types, labels)``, each (batch, seq) int64.

    Exactly ``max(1, round(mask_prob * seq))`` positions per row are masked: their token is replaced by the
    mask id (103, BERT's ``[MASK]``, or ``vocab - 1`` for small vocabularies) and their label is the original
    token; all other labels are -100. Token types are 0 for the first half of each row and 1 after (a
    sentence pair). Drawn from a private generator seeded with ``seed``.
    """
    t = cfg.seq_len if seq is None else seq
    if t > cfg.seq_len:
        raise InputError(f"seq={t} exceeds the model's seq_len={cfg.seq_len}")
    g = torch.Generator().manual_seed(seed)
    original = torch.randint(0, cfg.vocab, (batch, t), generator=g, dtype=torch.long)
    n_masked = max(1, round(mask_prob * t))
    picked = torch.rand(batch, t, generator=g).argsort(dim=1)[:, :n_masked]
    masked = torch.zeros(batch, t, dtype=torch.bool).scatter_(1, picked, True)
    mask_id = 103 if cfg.vocab > 103 else cfg.vocab - 1
    tokens = torch.where(masked, torch.full_like(original, mask_id), original)
    labels = torch.where(masked, original, torch.full_like(original, -100))
    types = (torch.arange(t) >= t // 2).long().expand(batch, t).contiguous()
    return tokens, types.clamp_(max=cfg.type_vocab - 1), labels
