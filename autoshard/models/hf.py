"""Hugging Face causal LMs built from small configs (random init, nothing downloaded).

``transformers`` is an optional dependency (the ``test`` extra); it is imported lazily.
Every model is built with dropout 0, ``use_cache=False`` and SDPA attention so its
forward is deterministic and traces with ``aot_export_joint_with_descriptors`` under
``FakeTensorMode``.

Loss convention (Hugging Face's ``ForCausalLMLoss``): ``labels`` has the same shape as
``input_ids`` and is shifted *inside* the model, so the loss is::

    F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))

(labels equal to -100 are ignored). Pass ``labels=input_ids`` for plain LM training.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["ATTN_IMPLEMENTATION", "CausalLMWithLoss", "hf_gpt2", "hf_llama", "init_rotary_buffers"]



def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "autoshard.models.hf needs the optional 'transformers' package: "
            "pip install 'autoshard[test]' (or pip install transformers)"
        ) from e
    return transformers


class CausalLMWithLoss(nn.Module):
    """Wraps a ``transformers`` causal LM so that ``forward(input_ids, labels)`` returns the loss.

    The wrapped model is ``self.model``; parameter names are prefixed ``model.``.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        # No attention_mask (plain causal LM); see _register_attention for why the mask
        # machinery is bypassed so that the module traces under FakeTensorMode.
        out = self.model(input_ids=input_ids, labels=labels, use_cache=False, return_dict=True)
        return out.loss


#: Name under which transformers' own SDPA attention function is registered for our models.
ATTN_IMPLEMENTATION = "autoshard_sdpa"


def _register_attention(tf: Any) -> str:
    """Register transformers' SDPA kernel under :data:`ATTN_IMPLEMENTATION` (idempotent).

    Why not plain ``"sdpa"``: for it, ``create_causal_mask`` inspects ``position_ids`` for
    packed sequences with a data-dependent Python branch (``(...).all()``) that transformers
    only skips under dynamo/FakeTensor inputs -- ``aot_export_joint_with_descriptors`` feeds
    FunctionalTensors, so tracing fails with ``DataDependentOutputException``. Mask creation
    is skipped for attention implementations without a registered mask function, so under
    this name the attention mask is ``None`` and the same ``sdpa_attention_forward`` calls
    ``F.scaled_dot_product_attention(..., is_causal=True)``: identical numerics, no mask
    tensors or data-dependent code in the graph.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    interface = tf.AttentionInterface
    if ATTN_IMPLEMENTATION not in interface._global_mapping:
        interface.register(ATTN_IMPLEMENTATION, sdpa_attention_forward)
    return ATTN_IMPLEMENTATION


def _finish(model: nn.Module) -> CausalLMWithLoss:
    # A literal loss_type avoids the "unrecognized loss_type" logger call (graph break
    # under dynamo) and pins the standard next-token cross-entropy.
    model.loss_type = "ForCausalLM"
    model.train()  # no dropout anywhere (all probabilities are 0), so train == eval numerically
    return CausalLMWithLoss(model)


def hf_gpt2(
    n_layer: int = 2,
    d_model: int = 64,
    n_head: int = 4,
    vocab: int = 256,
    n_positions: int = 64,
    seed: int = 0,
) -> CausalLMWithLoss:
    """A randomly initialised ``GPT2LMHeadModel`` (tied LM head) wrapped to return the loss."""
    tf = _import_transformers()
    cfg = tf.GPT2Config(
        n_layer=n_layer,
        n_embd=d_model,
        n_head=n_head,
        vocab_size=vocab,
        n_positions=n_positions,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
        use_cache=False,
        tie_word_embeddings=True,
        bos_token_id=vocab - 1,
        eos_token_id=vocab - 1,
    )
    cfg._attn_implementation = _register_attention(tf)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.GPT2LMHeadModel(cfg)
    return _finish(model)


def hf_llama(
    n_layer: int = 2,
    d_model: int = 64,
    n_head: int = 4,
    n_kv_head: int = 2,
    ffn: int = 128,
    vocab: int = 256,
    max_pos: int = 64,
    seed: int = 0,
) -> CausalLMWithLoss:
    """A randomly initialised ``LlamaForCausalLM`` (GQA, untied head) wrapped to return the loss."""
    tf = _import_transformers()
    cfg = tf.LlamaConfig(
        num_hidden_layers=n_layer,
        hidden_size=d_model,
        num_attention_heads=n_head,
        num_key_value_heads=n_kv_head,
        intermediate_size=ffn,
        vocab_size=vocab,
        max_position_embeddings=max_pos,
        attention_dropout=0.0,
        mlp_bias=False,
        attention_bias=False,
        use_cache=False,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = _register_attention(tf)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.LlamaForCausalLM(cfg)
    return _finish(model)


@torch.no_grad()
def init_rotary_buffers(module: nn.Module) -> int:
    """Recompute the rotary ``inv_freq`` / ``original_inv_freq`` buffers of every RoPE submodule.

    These buffers are non-persistent (absent from ``state_dict``) and computed at construction,
    so a model built on ``meta`` and materialised with ``to_empty`` holds garbage in them (and
    ``load_state_dict`` does not fix it). Call this after ``to_empty``. Returns how many
    rotary modules were re-initialised.
    """
    count = 0
    for mod in module.modules():
        inv_freq = getattr(mod, "inv_freq", None)
        config = getattr(mod, "config", None)
        if not isinstance(inv_freq, Tensor) or config is None or not hasattr(mod, "rope_type"):
            continue
        if mod.rope_type == "default" and hasattr(mod, "compute_default_rope_parameters"):
            init_fn = mod.compute_default_rope_parameters
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            init_fn = ROPE_INIT_FUNCTIONS[mod.rope_type]
        fresh, _ = init_fn(config, device=torch.device("cpu"))
        mod.inv_freq.copy_(fresh)
        if isinstance(getattr(mod, "original_inv_freq", None), Tensor):
            mod.original_inv_freq.copy_(fresh)
        count += 1
    return count
