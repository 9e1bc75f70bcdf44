"""A Vision Transformer classifier (Dosovitskiy et al. 2021), ``forward(images, labels)`` returns the loss.

The module layout (sharding plans refer to these names)::

    patch_embed                  Linear (channels * patch * patch -> D, bias) over flattened patches
    cls_token                    learned class token (1, 1, D)
    pos_embed                    learned positions (1, n_patches + 1, D)
    layers[i].norm1              pre-attention LayerNorm
    layers[i].attn.wq/wk/wv/wo   bidirectional self-attention (D -> D, bias)
    layers[i].norm2              pre-MLP LayerNorm
    layers[i].mlp.fc1/fc2        D -> mlp -> D, exact (erf) GELU
    norm                         final LayerNorm
    head                         Linear D -> n_classes on the class token

The patch embedding is written as reshape/permute + ``nn.Linear``: each (channels, patch, patch) block is
flattened in that order and multiplied by a (D, channels * patch * patch) weight, which equals the usual
stride-``patch`` convolution with that weight viewed as (D, channels, patch, patch) — but traces as a plain
matmul that a planner can shard. No dropout; the loss is cross-entropy of the class-token logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autoshard.errors import InputError
from autoshard.models.bert import MLP, SelfAttention, init_encoder_weights

__all__ = ["ViT", "ViTBlock", "ViTConfig", "patchify", "vit_example_inputs"]


@dataclass(frozen=True)
class ViTConfig:
    """Shape of a :class:`ViT`. Images are square, ``image_size`` a multiple of ``patch``."""

    n_layer: int = 2
    d_model: int = 256
    n_head: int = 8
    mlp: int = 1024
    image_size: int = 32
    patch: int = 8
    channels: int = 3
    n_classes: int = 10
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.d_model % self.n_head != 0:
            raise InputError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if self.image_size % self.patch != 0:
            raise InputError(f"image_size={self.image_size} is not a multiple of patch={self.patch}")

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch) ** 2

    @property
    def seq_len(self) -> int:
        """Tokens per image: the patches plus the class token."""
        return self.n_patches + 1

    @property
    def patch_dim(self) -> int:
        return self.channels * self.patch * self.patch

    @classmethod
    def vit_h14(cls, image_size: int = 224) -> ViTConfig:
        """ViT-H/14 (Dosovitskiy et al. 2021, table 1): 32 layers, d_model 1280, 16 heads, MLP 5120, patch 14;
        224-pixel images (256 patches + class token), 1000 ImageNet classes."""
        return cls(n_layer=32, d_model=1280, n_head=16, mlp=5120, image_size=image_size, patch=14, n_classes=1000)


def patchify(images: Tensor, patch: int) -> Tensor:
    """(B, C, H, W) -> (B, H/p * W/p, C * p * p): row-major patches, each flattened as (channel, row, col)."""
    b, c, h, w = images.shape
    x = images.reshape(b, c, h // patch, patch, w // patch, patch)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(b, (h // patch) * (w // patch), c * patch * patch)


class ViTBlock(nn.Module):
    """Pre-LayerNorm encoder block: ``x + attn(norm1(x))``, then ``+ mlp(norm2(.))``."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = SelfAttention(cfg.d_model, cfg.n_head)
        self.norm2 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = MLP(cfg.d_model, cfg.mlp)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """ViT classifier; ``forward(images, labels)`` returns the mean cross-entropy of the class-token logits."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.patch_embed = nn.Linear(cfg.patch_dim, d)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embed = nn.Parameter(torch.zeros(1, cfg.seq_len, d))
        self.layers = nn.ModuleList(ViTBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.head = nn.Linear(d, cfg.n_classes)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """N(0, 0.02) weights and position/class embeddings, zero biases, unit LayerNorms (no-op on meta)."""
        if self.cls_token.device.type == "meta":
            return
        init_encoder_weights(self)
        nn.init.normal_(self.cls_token, std=0.02)
        nn.init.normal_(self.pos_embed, std=0.02)

    def forward(self, images: Tensor, labels: Tensor) -> Tensor:
        cfg = self.cfg
        if tuple(images.shape[1:]) != (cfg.channels, cfg.image_size, cfg.image_size):
            raise InputError(
                f"images of shape {tuple(images.shape)}; this ViT takes (B, {cfg.channels}, {cfg.image_size}, "
                f"{cfg.image_size})"
            )
        x = self.patch_embed(patchify(images.to(self.patch_embed.weight.dtype), cfg.patch))
        cls = self.cls_token.expand(x.shape[0], 1, cfg.d_model)
        x = torch.cat((cls, x), dim=1) + self.pos_embed
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x[:, 0]))
        return F.cross_entropy(logits, labels)


def vit_example_inputs(
    cfg: ViTConfig, batch: int, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """Random ``(images, labels)``: (batch, channels, image_size, image_size) standard normal pixels of
    ``dtype`` and (batch,) int64 class labels, from a private generator seeded with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, cfg.channels, cfg.image_size, cfg.image_size, generator=g).to(dtype)
    labels = torch.randint(0, cfg.n_classes, (batch,), generator=g, dtype=torch.long)
    return images, labels
