"""Tiny stock Hugging Face models and batches, as their users build and call them (random init, nothing
downloaded): the architectures ``benchmarks/hf_compat.py`` reports on and the tests train.

Each entry builds the stock ``transformers`` class from its config class with small sizes and otherwise the
config's defaults (default attention implementation, ``use_cache``, tied embeddings), and a batch of keyword
arguments the way the model is called in training: ``input_ids``, an ``attention_mask`` with real left
padding and ``labels`` (-100 on the padding) for language models, ``pixel_values`` and ``labels`` for the
vision models (ViT, ResNet, ConvNeXt, EfficientNet, Swin).

``dropout=False`` sets the configs' dropout probabilities to 0: for comparisons with one device that do not seed
each step (a sharded step draws one device's masks only from the same generator state, docs/guide/api.md "Random
numbers") and for pipeline stages, which draw from streams of their own (``transformers`` is imported lazily; it is
in the ``test`` extra).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["TINY", "TinyModel", "build"]

VOCAB = 256
PAD, BOS, EOS = 0, 1, 2


@dataclass(frozen=True)
class TinyModel:
    """One architecture: how to build it and a batch for it."""

    name: str
    cls: str  # the transformers model class
    task: str
    make_config: Callable[[Any], Any]  # transformers module -> config
    make_batch: Callable[[int, int, int], dict[str, torch.Tensor]]  # (batch, seq, seed) -> keyword arguments
    library: str = "transformers"  # the package the class comes from ("diffusers": its config is keyword arguments)
    wrap: Callable[[nn.Module], nn.Module] | None = None  # the training step users write around it (a loss)


def _import(library: str = "transformers") -> Any:
    try:
        return importlib.import_module(library)
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(f"autoshard.models.hf needs {library!r}: pip install 'autoshard[test]'") from e


class DenoisingLoss(nn.Module):
    """A diffusion model's training step as users write it (DDPM's): the noise added to an image at a timestep,
    predicted by the UNet, scored by the mean squared error."""

    def __init__(self, unet: nn.Module) -> None:
        super().__init__()
        self.unet = unet

    def forward(self, noisy: torch.Tensor, timesteps: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.unet(noisy, timesteps).sample, noise)


def denoising_batch(batch: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "noisy": torch.randn(batch, 3, 16, 16, generator=g),
        "timesteps": torch.randint(0, 1000, (batch,), generator=g),
        "noise": torch.randn(batch, 3, 16, 16, generator=g),
    }


def _padded(batch: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for row in range(0, batch, 2):  # every other sequence is left-padded by a different amount
        pad = (row // 2 * 3 + 2) % max(seq // 2, 1) + 1
        mask[row, :pad] = 0
        ids[row, :pad] = PAD
    return ids, mask


def lm_batch(batch: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    """A causal-LM batch: labels are the inputs (the model shifts them), -100 on padding."""
    ids, mask = _padded(batch, seq, seed)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def mlm_batch(batch: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    """A masked-LM batch: every third real token is predicted."""
    ids, mask = _padded(batch, seq, seed)
    labels = torch.full_like(ids, -100)
    labels[:, ::3] = ids[:, ::3]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels.masked_fill(mask == 0, -100)}


def seq2seq_batch(batch: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    """An encoder-decoder batch: padded source, targets half as long (the model makes decoder inputs)."""
    ids, mask = _padded(batch, seq, seed)
    g = torch.Generator().manual_seed(seed + 1)
    labels = torch.randint(3, VOCAB, (batch, max(seq // 2, 1)), generator=g)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def image_batch(batch: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "pixel_values": torch.randn(batch, 3, 32, 32, generator=g),
        "labels": torch.randint(0, 10, (batch,), generator=g),
    }


_DECODER = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=VOCAB,
    num_hidden_layers=2,
    pad_token_id=PAD,
    bos_token_id=BOS,
    eos_token_id=EOS,
)

TINY: dict[str, TinyModel] = {
    m.name: m
    for m in (
        TinyModel(
            "gpt2",
            "GPT2LMHeadModel",
            "causal LM",
            lambda tf: tf.GPT2Config(
                n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, bos_token_id=BOS, eos_token_id=EOS
            ),
            lm_batch,
        ),
        TinyModel("llama", "LlamaForCausalLM", "causal LM", lambda tf: tf.LlamaConfig(**_DECODER), lm_batch),
        TinyModel("mistral", "MistralForCausalLM", "causal LM", lambda tf: tf.MistralConfig(**_DECODER), lm_batch),
        TinyModel("qwen2", "Qwen2ForCausalLM", "causal LM", lambda tf: tf.Qwen2Config(**_DECODER), lm_batch),
        TinyModel(
            "gemma", "GemmaForCausalLM", "causal LM", lambda tf: tf.GemmaConfig(head_dim=16, **_DECODER), lm_batch
        ),
        TinyModel("phi3", "Phi3ForCausalLM", "causal LM", lambda tf: tf.Phi3Config(**_DECODER), lm_batch),
        TinyModel(
            "mixtral",
            "MixtralForCausalLM",
            "causal LM (MoE)",
            lambda tf: tf.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **_DECODER),
            lm_batch,
        ),
        TinyModel(
            "bert",
            "BertForMaskedLM",
            "masked LM",
            lambda tf: tf.BertConfig(
                hidden_size=64,
                num_attention_heads=4,
                intermediate_size=128,
                vocab_size=VOCAB,
                num_hidden_layers=2,
                pad_token_id=PAD,
            ),
            mlm_batch,
        ),
        TinyModel(
            "t5",
            "T5ForConditionalGeneration",
            "encoder-decoder",
            lambda tf: tf.T5Config(
                d_model=64,
                d_kv=16,
                num_heads=4,
                d_ff=128,
                vocab_size=VOCAB,
                num_layers=2,
                pad_token_id=PAD,
                eos_token_id=EOS,
                decoder_start_token_id=PAD,
            ),
            seq2seq_batch,
        ),
        TinyModel(
            "vit",
            "ViTForImageClassification",
            "image classification",
            lambda tf: tf.ViTConfig(
                hidden_size=64,
                num_attention_heads=4,
                intermediate_size=128,
                num_hidden_layers=2,
                image_size=32,
                patch_size=8,
                num_labels=10,
            ),
            image_batch,
        ),
        # convolutional vision models (BatchNorm's running statistics updated in training: ResNet, EfficientNet)
        TinyModel(
            "resnet",
            "ResNetForImageClassification",
            "image classification (BatchNorm)",
            lambda tf: tf.ResNetConfig(
                embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10, layer_type="basic"
            ),
            image_batch,
        ),
        TinyModel(
            "convnext",
            "ConvNextForImageClassification",
            "image classification (LayerNorm)",
            lambda tf: tf.ConvNextConfig(
                num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10, image_size=32
            ),
            image_batch,
        ),
        TinyModel(
            "efficientnet",
            "EfficientNetForImageClassification",
            "image classification (BatchNorm)",
            lambda tf: tf.EfficientNetConfig(
                image_size=32, width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320, num_labels=10
            ),
            image_batch,
        ),
        TinyModel(
            "swin",
            "SwinForImageClassification",
            "image classification (windows)",
            lambda tf: tf.SwinConfig(
                image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4, num_labels=10
            ),
            image_batch,
        ),
        TinyModel(
            "unet2d",
            "UNet2DModel",
            "diffusion (denoising loss)",
            lambda lib: dict(
                sample_size=16,
                in_channels=3,
                out_channels=3,
                layers_per_block=1,
                block_out_channels=(16, 32),
                down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                up_block_types=("AttnUpBlock2D", "UpBlock2D"),
                norm_num_groups=8,
            ),
            denoising_batch,
            library="diffusers",
            wrap=DenoisingLoss,
        ),
    )
}


def _no_dropout(config: Any) -> Any:
    for key, value in list(vars(config).items()):
        if isinstance(value, float) and any(w in key for w in ("dropout", "pdrop", "drop_path", "drop_connect")):
            setattr(config, key, 0.0)
    return config


def build(
    name: str,
    *,
    batch: int = 4,
    seq: int = 16,
    seed: int = 0,
    dropout: bool = True,
    device: str | torch.device | None = None,
    layers: int | None = None,
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The stock model ``name`` (see ``TINY``) in train mode, seeded, and a batch of keyword arguments;
    ``layers`` overrides the number of blocks (2 by default)."""
    if name not in TINY:
        raise KeyError(f"no tiny Hugging Face model {name!r}; known: {sorted(TINY)}")
    spec = TINY[name]
    lib = _import(spec.library)
    config = spec.make_config(lib)
    if not dropout and not isinstance(config, dict):  # (the diffusion UNet's default dropout is 0)
        config = _no_dropout(config)
    if layers is not None and not isinstance(config, dict):
        for key in ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers"):
            if hasattr(config, key):
                setattr(config, key, layers)

    def make() -> nn.Module:
        model = getattr(lib, spec.cls)(**config) if isinstance(config, dict) else getattr(lib, spec.cls)(config)
        return spec.wrap(model) if spec.wrap is not None else model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if device is not None:
            with torch.device(device):
                model = make()
        else:
            model = make()
    model.train()
    return model, spec.make_batch(batch, seq, seed + 1)
