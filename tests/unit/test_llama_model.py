"""Fast checks of the hand-written Llama model (no process group)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from autoshard.models.llama import (
    Attention,
    Llama,
    LlamaConfig,
    apply_rotary,
    llama_example_inputs,
    rope_tables,
)

TINY = LlamaConfig(n_layer=2, d_model=64, n_head=4, n_kv_head=2, ffn=96, vocab=128, seq_len=32)


def _tiny(cfg: LlamaConfig = TINY, seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(cfg)


def test_llama3_8b_builds_on_meta_without_allocating() -> None:
    cfg = LlamaConfig.llama3_8b()
    with torch.device("meta"):
        model = Llama(cfg)
    tensors = list(model.parameters()) + list(model.buffers())
    assert all(t.device.type == "meta" for t in tensors)
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248  # Llama-3 8B
    assert tuple(model.rope_cos.shape) == (2048, 64)
    assert model.layers[0].attention.wk.weight.shape == (8 * 128, 4096)  # 8 key/value heads of 128


def test_forward_returns_finite_scalar_near_log_vocab() -> None:
    model = _tiny()
    loss = model(*llama_example_inputs(TINY, batch=2))
    assert loss.shape == ()
    assert torch.isfinite(loss)
    assert abs(loss.item() - math.log(TINY.vocab)) < 1.0  # small init: close to uniform


def test_shorter_sequence_and_too_long_sequence() -> None:
    model = _tiny()
    assert torch.isfinite(model(*llama_example_inputs(TINY, batch=2, seq=8)))
    with pytest.raises(ValueError, match="seq"):
        llama_example_inputs(TINY, batch=1, seq=TINY.seq_len + 1)


def test_backward_reaches_every_parameter() -> None:
    model = _tiny()
    model(*llama_example_inputs(TINY, batch=2)).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_gqa_matches_attention_with_repeated_heads() -> None:
    """n_kv_head < n_head: key/value head j serves query heads j*rep .. j*rep+rep-1 (SDPA's enable_gqa)."""
    torch.manual_seed(0)
    attn = Attention(TINY)
    x = torch.randn(2, 16, TINY.d_model)
    cos, sin = rope_tables(16, TINY.head_dim, TINY.rope_theta)
    got = attn(x, cos, sin)

    b, t, hd = 2, 16, TINY.head_dim
    q = attn.wq(x).view(b, t, TINY.n_head, hd).transpose(1, 2)
    k = attn.wk(x).view(b, t, TINY.n_kv_head, hd).transpose(1, 2)
    v = attn.wv(x).view(b, t, TINY.n_kv_head, hd).transpose(1, 2)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    rep = TINY.n_head // TINY.n_kv_head
    y = F.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), is_causal=True
    )
    want = attn.wo(y.transpose(1, 2).reshape(b, t, -1))
    torch.testing.assert_close(got, want)


def test_gqa_and_mha_configs_run() -> None:
    for n_kv in (1, 2, 4):
        cfg = LlamaConfig(n_layer=1, d_model=32, n_head=4, n_kv_head=n_kv, ffn=48, vocab=64, seq_len=8)
        model = _tiny(cfg)
        assert model.layers[0].attention.wk.weight.shape == (n_kv * cfg.head_dim, cfg.d_model)
        assert torch.isfinite(model(*llama_example_inputs(cfg, batch=2)))


def test_rotary_is_a_rotation_of_each_half_pair() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 10, 8)
    cos, sin = rope_tables(10, 8, 10000.0)
    got = apply_rotary(x, cos, sin)
    z = torch.complex(x[..., :4], x[..., 4:]) * torch.polar(torch.ones_like(cos), torch.atan2(sin, cos))
    torch.testing.assert_close(got, torch.cat((z.real, z.imag), dim=-1))
    torch.testing.assert_close(got.norm(dim=-1), x.norm(dim=-1))  # rotations keep the norm
    torch.testing.assert_close(got[:, :, 0], x[:, :, 0])  # position 0 is not rotated


def test_rmsnorm_keeps_input_dtype() -> None:
    model = _tiny().to(torch.bfloat16)
    x = torch.randn(2, 4, TINY.d_model, dtype=torch.bfloat16)
    assert model.norm(x).dtype == torch.bfloat16


def test_rope_buffers_are_not_state_and_init_weights_refills_them() -> None:
    model = _tiny()
    assert not any(k.startswith("rope_") for k in model.state_dict())
    with torch.device("meta"):
        meta = Llama(TINY)
    meta.to_empty(device="cpu")
    meta.init_weights()
    torch.testing.assert_close(meta.rope_cos, model.rope_cos)
    torch.testing.assert_close(meta.rope_sin, model.rope_sin)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="n_kv_head"):
        LlamaConfig(n_head=8, n_kv_head=3)
    with pytest.raises(ValueError, match="divisible"):
        LlamaConfig(d_model=100, n_head=8)
    big = LlamaConfig.llama3_8b(seq_len=8192)
    assert (big.n_layer, big.d_model, big.n_head, big.n_kv_head, big.ffn, big.vocab, big.seq_len) == (
        32, 4096, 32, 8, 14336, 128256, 8192,
    )  # fmt: skip
