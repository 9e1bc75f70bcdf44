"""A model zoo: published model shapes as configs, built on the meta device (no weights) for planning.

``get_model("llama3-70b")`` returns a :class:`ZooModel`: the config of one of autoshard's hand-written model
classes (:mod:`~autoshard.models.gpt`, :mod:`~autoshard.models.llama`, :mod:`~autoshard.models.moe`,
:mod:`~autoshard.models.bert`, :mod:`~autoshard.models.vit`) plus what a planner or benchmark needs around it:
``build(num_layers=...)`` (capture a few layers and scale), global-shaped ``example_inputs``, the exact
``num_params`` and the model FLOPs per sample for MFU. ``get_model`` also accepts a path to a Hugging Face
``config.json`` (read as plain JSON; ``transformers`` is not imported).

FLOPs convention (:meth:`ZooModel.train_flops_per_sample`): training = 3 x forward, forward = 2 FLOPs per
multiply-add of every matmul weight times the tokens it is applied to (LM heads included, embedding lookups,
norms and biases excluded), plus attention ``4 * seq^2 * d_attn`` per layer (QK^T and AV) counting the full
seq x seq square even for causal models, as Megatron-LM's and PaLM's MFU formulas do (a causal kernel does
about half of that work). For the MoE only the router and the top-k active experts count, not the capacity
padding nor the dispatch/combine einsums.

Default sequence lengths: the published training context (8192 for every Llama-3 size, including 8B; 1024 for
GPT-2, 4096 for Mixtral, 512 for BERT, 257 tokens for ViT-H/14 at 224 px). For a Hugging Face config it is
``min(max_position_embeddings, 8192)``.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor, nn

from autoshard.errors import InputError
from autoshard.messages import warn
from autoshard.models.bert import Bert, BertConfig, bert_example_inputs
from autoshard.models.gpt import GPT, GPTConfig, gpt_example_inputs
from autoshard.models.llama import Llama, LlamaConfig, llama_example_inputs
from autoshard.models.moe import MoEConfig, MoEDecoder, moe_example_inputs
from autoshard.models.vit import ViT, ViTConfig, vit_example_inputs

__all__ = ["ZooModel", "get_model", "known_models"]

log = logging.getLogger(__name__)

HF_MAX_DEFAULT_SEQ = 8192


# --------------------------------------------------------------------------------------------- families


def _attention_flops(layers: int, seq: int, width: int) -> float:
    return 4.0 * layers * seq * seq * width


def _gpt_flops(c: GPTConfig, s: int) -> float:
    d = c.d_model
    body = c.n_layer * (4 * d * d + 2 * d * c.mlp_ratio * d)
    return 2.0 * s * (body + c.vocab * d) + _attention_flops(c.n_layer, s, d)


def _gqa_decoder_flops(c: LlamaConfig | MoEConfig, s: int, ffn_params: int) -> float:
    """Llama-style decoder: q/o projections d x (heads * head_dim), k/v d x (kv heads * head_dim), LM head."""
    q, kv = c.n_head * c.head_dim, c.n_kv_head * c.head_dim
    per_layer = 2 * c.d_model * q + 2 * c.d_model * kv + ffn_params
    return 2.0 * s * (c.n_layer * per_layer + c.vocab * c.d_model) + _attention_flops(c.n_layer, s, q)


def _llama_flops(c: LlamaConfig, s: int) -> float:
    return _gqa_decoder_flops(c, s, 3 * c.d_model * c.ffn)


def _moe_flops(c: MoEConfig, s: int) -> float:
    return _gqa_decoder_flops(c, s, c.d_model * c.n_experts + c.top_k * 3 * c.d_model * c.ffn)


def _bert_flops(c: BertConfig, s: int) -> float:
    d = c.d_model
    body = c.n_layer * (4 * d * d + 2 * d * c.ffn)
    return 2.0 * s * (body + d * d + c.vocab * d) + _attention_flops(c.n_layer, s, d)


def _vit_flops(c: ViTConfig, s: int) -> float:
    d = c.d_model
    patches = 2.0 * c.n_patches * c.patch_dim * d
    body = 2.0 * s * c.n_layer * (4 * d * d + 2 * d * c.mlp)
    return patches + body + 2.0 * d * c.n_classes + _attention_flops(c.n_layer, s, d)


def _vit_with_seq(c: ViTConfig, seq: int) -> ViTConfig:
    side = math.isqrt(max(seq - 1, 0))
    if seq < 2 or side * side != seq - 1:
        raise InputError(
            f"a ViT takes (image_size / patch)^2 + 1 tokens (patches + class token); seq={seq} is not a square "
            f"plus one (e.g. {c.seq_len} for {c.image_size} px images in {c.patch} px patches)"
        )
    return replace(c, image_size=side * c.patch)


@dataclass(frozen=True)
class _Family:
    """How the zoo drives one model class: construct, example inputs, forward FLOPs, sequence override."""

    make: Callable[[Any], nn.Module]
    inputs: Callable[[Any, int, int, int], tuple[Tensor, ...]]  # (config, batch, seq, seed) -> CPU tensors
    forward_flops: Callable[[Any, int], float]  # (config, tokens per sample) -> FLOPs of one forward
    with_seq: Callable[[Any, int], Any]


def _grow_seq(c: Any, seq: int) -> Any:
    """Position tables (learned or rotary) must cover ``seq``; shorter inputs keep the published table."""
    return c if seq <= c.seq_len else replace(c, seq_len=seq)


_FAMILIES: Mapping[str, _Family] = MappingProxyType(
    {
        "gpt": _Family(GPT, lambda c, b, s, seed: gpt_example_inputs(c, b, s, seed=seed), _gpt_flops, _grow_seq),
        "llama": _Family(Llama, lambda c, b, s, seed: llama_example_inputs(c, b, s, seed), _llama_flops, _grow_seq),
        "mixtral": _Family(MoEDecoder, lambda c, b, s, seed: moe_example_inputs(c, b, s, seed), _moe_flops, _grow_seq),
        "bert": _Family(Bert, lambda c, b, s, seed: bert_example_inputs(c, b, s, seed), _bert_flops, _grow_seq),
        "vit": _Family(ViT, lambda c, b, s, seed: vit_example_inputs(c, b, seed), _vit_flops, _vit_with_seq),
    }
)


# --------------------------------------------------------------------------------------------- ZooModel


@dataclass(frozen=True)
class ZooModel:
    """One model shape of the zoo (or of a Hugging Face config): its config and how to build and measure it."""

    name: str
    family: str  # "gpt" | "llama" | "mixtral" | "bert" | "vit"
    description: str
    config: Any  # the frozen config dataclass of the model class, full depth
    num_layers: int  # repeated blocks at full depth
    default_seq: int  # tokens per sample (ViT: patches + class token, derived from the image size)
    layers_path: str  # attribute path of the nn.ModuleList of repeated blocks

    def sized_config(self, num_layers: int | None = None, seq: int | None = None) -> Any:
        """The config with ``num_layers`` blocks and position tables (ViT: image size) for ``seq`` tokens."""
        cfg = self.config
        if num_layers is not None:
            if num_layers < 0:
                raise InputError(f"num_layers must be >= 0, got {num_layers}")
            cfg = replace(cfg, n_layer=num_layers)
        if seq is not None:
            cfg = _FAMILIES[self.family].with_seq(cfg, seq)
        return cfg

    def build(
        self,
        *,
        num_layers: int | None = None,
        seq: int | None = None,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "meta",
    ) -> nn.Module:
        """The model with ``num_layers`` blocks (default: full depth), parameters in ``dtype`` on ``device``.

        On ``meta`` nothing is allocated or initialised (for planning); on a real device weights are randomly
        initialised from torch's default RNG (seed it first for reproducible models)."""
        cfg = self.sized_config(num_layers, seq)
        with torch.device(device):
            model = _FAMILIES[self.family].make(cfg)
        return model.to(dtype)

    def example_inputs(
        self,
        batch: int,
        seq: int | None = None,
        device: str | torch.device = "meta",
        dtype: torch.dtype = torch.bfloat16,
        seed: int = 0,
    ) -> tuple[Tensor, ...]:
        """Global-shaped inputs of ``forward``: int64 tokens/labels (LMs, BERT) or ``dtype`` images + int64
        labels (ViT). On ``meta`` only shapes and dtypes are made (no host memory for big batches)."""
        cfg = self.sized_config(None, seq)
        s = self.default_seq if seq is None else seq
        meta = torch.device(device).type == "meta"
        made = _FAMILIES[self.family].inputs(cfg, 1 if meta else batch, s, seed)
        out = []
        for t in made:
            dt = dtype if t.is_floating_point() else t.dtype
            if meta:
                out.append(torch.empty((batch, *t.shape[1:]), dtype=dt, device="meta"))
            else:
                out.append(t.to(device=device, dtype=dt))
        return tuple(out)

    def num_params(self, num_layers: int | None = None) -> int:
        """Exact parameter count (tied weights once) at ``num_layers`` blocks (default: full depth).

        Counted by building 1- and 2-block models on meta: every block is identical, so the count is affine in
        the depth."""
        n = self.num_layers if num_layers is None else num_layers
        one, two = (sum(p.numel() for p in self.build(num_layers=k).parameters()) for k in (1, 2))
        return one + (n - 1) * (two - one)

    def tokens_per_sample(self, seq: int | None = None) -> int:
        """Sequence positions one sample occupies: ``seq`` for the LMs and BERT, patches + 1 for ViT."""
        if self.family == "vit":
            return self.sized_config(None, seq).seq_len
        return self.default_seq if seq is None else seq

    def train_flops_per_sample(self, seq: int | None = None) -> float:
        """Model FLOPs of forward + backward for one sample (3 x forward; convention in the module docstring)."""
        cfg = self.sized_config(None, seq)
        return 3.0 * _FAMILIES[self.family].forward_flops(cfg, self.tokens_per_sample(seq))


def _entry(name: str, family: str, description: str, cfg: Any) -> ZooModel:
    return ZooModel(name, family, description, cfg, cfg.n_layer, cfg.seq_len, "layers")


_ZOO: tuple[ZooModel, ...] = (
    _entry("gpt2-124m", "gpt", "GPT-2 small (Radford et al. 2019): 12 layers, d 768, 12 heads, GELU MLP 3072, "
           "vocab 50257, 1024 learned positions, tied head", GPTConfig.gpt2_124m()),
    _entry("gpt2-1.5b", "gpt", "GPT-2 XL (Radford et al. 2019): 48 layers, d 1600, 25 heads, GELU MLP 6400, "
           "vocab 50257, 1024 learned positions, tied head", GPTConfig.gpt2_1_5b()),
    _entry("llama3-8b", "llama", "Llama-3 8B shape (Llama 3 Herd of Models, 2024): 32 layers, d 4096, GQA 32/8 "
           "heads, SwiGLU 14336, vocab 128256, seq 8192", LlamaConfig.llama3_8b(seq_len=8192)),
    _entry("llama3-70b", "llama", "Llama-3 70B shape (Llama 3 Herd of Models, 2024): 80 layers, d 8192, GQA 64/8 "
           "heads, SwiGLU 28672, vocab 128256, seq 8192", LlamaConfig.llama3_70b()),
    _entry("llama3-405b", "llama", "Llama-3 405B shape (Llama 3 Herd of Models, 2024): 126 layers, d 16384, GQA "
           "128/8 heads, SwiGLU 53248, vocab 128256, seq 8192", LlamaConfig.llama3_405b()),
    _entry("mixtral-8x7b", "mixtral", "Mixtral 8x7B shape (Jiang et al. 2024): 32 layers, d 4096, GQA 32/8 heads, "
           "8 SwiGLU experts of 14336, top-2, vocab 32000, seq 4096", MoEConfig.mixtral_8x7b()),
    _entry("bert-large", "bert", "BERT-Large (Devlin et al. 2019): 24 layers, d 1024, 16 heads, GELU 4096, vocab "
           "30522, 512 positions, post-LN, masked-LM loss", BertConfig.bert_large()),
    _entry("vit-h14", "vit", "ViT-H/14 (Dosovitskiy et al. 2021): 32 layers, d 1280, 16 heads, MLP 5120, 224 px "
           "images in 14 px patches (256 + class token = 257 tokens), 1000 classes", ViTConfig.vit_h14()),
)  # fmt: skip


def known_models() -> tuple[str, ...]:
    """Names :func:`get_model` accepts (besides a Hugging Face config.json path)."""
    return tuple(m.name for m in _ZOO)


# --------------------------------------------------------------------------------------------- HF configs


def _get(j: Mapping[str, Any], key: str, default: Any = None) -> Any:
    if key in j and j[key] is not None:
        return j[key]
    if default is None:
        raise InputError(f"Hugging Face config lacks {key!r}, which this model type needs")
    return default


def _check_head_dim(j: Mapping[str, Any], d: int, heads: int) -> None:
    hd = j.get("head_dim")
    if hd is not None and hd != d // heads:
        raise InputError(f"head_dim={hd} differs from hidden_size / num_attention_heads = {d // heads}; unsupported")


def _hf_seq(j: Mapping[str, Any], default: int) -> int:
    return min(int(_get(j, "max_position_embeddings", default)), HF_MAX_DEFAULT_SEQ)


def _hf_llama(j: Mapping[str, Any]) -> tuple[str, Any]:
    d, heads = _get(j, "hidden_size"), _get(j, "num_attention_heads")
    _check_head_dim(j, d, heads)
    if j.get("tie_word_embeddings"):
        warn(log, "tie_word_embeddings=true: autoshard's Llama has an untied output head (vocab x d more params)")
    if j.get("sliding_window"):
        log.info("sliding_window=%s ignored: full causal attention", j["sliding_window"])
    return "llama", LlamaConfig(
        n_layer=_get(j, "num_hidden_layers"), d_model=d, n_head=heads, n_kv_head=_get(j, "num_key_value_heads", heads),
        ffn=_get(j, "intermediate_size"), vocab=_get(j, "vocab_size"), seq_len=_hf_seq(j, 2048),
        rope_theta=float(_get(j, "rope_theta", 10000.0)), norm_eps=float(_get(j, "rms_norm_eps", 1e-6)),
    )  # fmt: skip


def _hf_mixtral(j: Mapping[str, Any]) -> tuple[str, Any]:
    d, heads = _get(j, "hidden_size"), _get(j, "num_attention_heads")
    _check_head_dim(j, d, heads)
    return "mixtral", MoEConfig(
        n_layer=_get(j, "num_hidden_layers"), d_model=d, n_head=heads, n_kv_head=_get(j, "num_key_value_heads", heads),
        ffn=_get(j, "intermediate_size"), n_experts=_get(j, "num_local_experts", 8),
        top_k=_get(j, "num_experts_per_tok", 2),
        vocab=_get(j, "vocab_size"), seq_len=_hf_seq(j, 4096), rope_theta=float(_get(j, "rope_theta", 1e6)),
        norm_eps=float(_get(j, "rms_norm_eps", 1e-5)), aux_loss_coef=float(_get(j, "router_aux_loss_coef", 0.01)),
    )  # fmt: skip


def _hf_gpt2(j: Mapping[str, Any]) -> tuple[str, Any]:
    d = _get(j, "n_embd", 768)
    inner = j.get("n_inner") or 4 * d
    if inner % d:
        raise InputError(f"n_inner={inner} is not a multiple of n_embd={d}; autoshard's GPT takes an integer mlp_ratio")
    return "gpt", GPTConfig(
        n_layer=_get(j, "n_layer", 12), d_model=d, n_head=_get(j, "n_head", 12), vocab=_get(j, "vocab_size", 50257),
        seq_len=_get(j, "n_positions", 1024), mlp_ratio=inner // d, bias=True,
    )  # fmt: skip


def _hf_bert(j: Mapping[str, Any]) -> tuple[str, Any]:
    return "bert", BertConfig(
        n_layer=_get(j, "num_hidden_layers"), d_model=_get(j, "hidden_size"), n_head=_get(j, "num_attention_heads"),
        ffn=_get(j, "intermediate_size"), vocab=_get(j, "vocab_size"), seq_len=_hf_seq(j, 512),
        type_vocab=_get(j, "type_vocab_size", 2), norm_eps=float(_get(j, "layer_norm_eps", 1e-12)),
    )  # fmt: skip


def _hf_vit(j: Mapping[str, Any]) -> tuple[str, Any]:
    labels = j.get("num_labels") or len(j.get("id2label") or {}) or 1000
    return "vit", ViTConfig(
        n_layer=_get(j, "num_hidden_layers"), d_model=_get(j, "hidden_size"), n_head=_get(j, "num_attention_heads"),
        mlp=_get(j, "intermediate_size"), image_size=_get(j, "image_size", 224), patch=_get(j, "patch_size", 16),
        channels=_get(j, "num_channels", 3), n_classes=labels, norm_eps=float(_get(j, "layer_norm_eps", 1e-12)),
    )  # fmt: skip


_HF_TYPES: Mapping[str, Callable[[Mapping[str, Any]], tuple[str, Any]]] = MappingProxyType(
    {
        "llama": _hf_llama,
        "mistral": _hf_llama,
        "mixtral": _hf_mixtral,
        "gpt2": _hf_gpt2,
        "bert": _hf_bert,
        "vit": _hf_vit,
    }
)


def _describe(family: str, c: Any) -> str:
    if family == "vit":
        return (f"{c.n_layer} layers, d {c.d_model}, {c.n_head} heads, MLP {c.mlp}, {c.image_size} px images in "
                f"{c.patch} px patches ({c.seq_len} tokens), {c.n_classes} classes")  # fmt: skip
    heads = f"GQA {c.n_head}/{c.n_kv_head} heads" if hasattr(c, "n_kv_head") else f"{c.n_head} heads"
    ffn = {"gpt": lambda: f"GELU MLP {c.mlp_ratio * c.d_model}", "bert": lambda: f"GELU {c.ffn}",
           "llama": lambda: f"SwiGLU {c.ffn}",
           "mixtral": lambda: f"{c.n_experts} SwiGLU experts of {c.ffn}, top-{c.top_k}"}[family]()  # fmt: skip
    return f"{c.n_layer} layers, d {c.d_model}, {heads}, {ffn}, vocab {c.vocab}, seq {c.seq_len}"


def _from_hf(path: Path) -> ZooModel:
    try:
        j = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"{path} is not valid JSON: {e}") from e
    mt = j.get("model_type") if isinstance(j, dict) else None
    parse = _HF_TYPES.get(mt)
    if parse is None:
        raise InputError(
            f"{path}: model_type {mt!r} is not supported; supported Hugging Face model types: "
            f"{', '.join(sorted(_HF_TYPES))}"
        )
    try:
        family, cfg = parse(j)
    except (ValueError, TypeError) as e:
        raise InputError(f"{path} ({mt}): {e}") from e
    stem = path.parent.name if path.stem == "config" and path.parent.name else path.stem
    return _entry(f"hf:{mt}:{stem}", family, f"{mt} from {path.name}: {_describe(family, cfg)}", cfg)


def get_model(name_or_path: str) -> ZooModel:
    """A zoo model by name (see :func:`known_models`), or one built from a Hugging Face ``config.json`` path
    (or a directory holding one). The HF model is named ``hf:<model_type>:<stem>``, where the stem of a file
    called ``config.json`` is its directory's name."""
    for m in _ZOO:
        if m.name == name_or_path.lower():
            return m
    path = Path(name_or_path)
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.is_file():
        return _from_hf(path)
    raise InputError(
        f"unknown model {name_or_path!r}: known models are {', '.join(known_models())}; a path to a Hugging Face "
        f"config.json is also accepted (model_type {', '.join(sorted(_HF_TYPES))})"
    )
