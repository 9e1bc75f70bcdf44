"""Context-parallel attention kernels against the single-device kernel, forward and backward.

``autoshard/rules/causal_chunks.py`` (query chunks against gathered keys and values, balanced by swapping
half-chunks with the mirror rank) and ``autoshard/rules/ring_attention.py`` (keys and values passed around a
ring, merged by log-sum-exp) on 2 and 4 simulated ranks: each rank's output, log-sum-exp and gradients equal the
slices of the whole-sequence kernel's (float64, GQA: 4 query heads on 2 key/value heads)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from autoshard.rules import causal_chunks, ring_attention

from harness import local_ranks

FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _whole(causal: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 32, 8, dtype=torch.float64, generator=g)
    k, v = (torch.randn(1, 2, 32, 8, dtype=torch.float64, generator=g) for _ in range(2))
    grad = torch.randn(1, 4, 32, 8, dtype=torch.float64, generator=g)
    out, lse = FWD(q, k, v, 0.0, causal)[:2]
    dq, dk, dv = BWD(grad, q, k, v, out, lse, 0.0, causal)[:3]
    return [q, k, v, grad, out, lse], [out, lse, dq, dk, dv]


def _check(got: torch.Tensor, want: torch.Tensor, mesh, placement) -> None:
    local = distribute_tensor(want, mesh, [placement]).to_local()
    assert torch.allclose(got, local, atol=1e-10), (got - local).abs().max()


@pytest.mark.parametrize("n", [2, 4])
def test_balanced_causal_chunks_equal_the_whole_kernel(n: int) -> None:
    (q, k, v, grad, out, lse), (w_out, w_lse, w_dq, w_dk, w_dv) = _whole(True)
    with local_ranks(n):
        mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("cp",))
        seq = lambda t: distribute_tensor(t, mesh, [Shard(2)]).to_local()  # noqa: E731
        rep = lambda t: distribute_tensor(t, mesh, [Replicate()]).to_local()  # noqa: E731
        o, l = causal_chunks.forward(FWD, seq(q), rep(k), rep(v), mesh, 0, {})
        _check(o, w_out, mesh, Shard(2))
        _check(l, w_lse, mesh, Shard(2))
        dq, dk, dv = causal_chunks.backward(BWD, seq(grad), seq(q), rep(k), rep(v), seq(out), seq(lse), mesh, 0, {})
        _check(dq, w_dq, mesh, Shard(2))
        for grad_part, want in ((dk, w_dk), (dv, w_dv)):  # Partial: the ranks' shares sum to the gradient
            summed = torch.stack([grad_part._local_tensors[r] for r in range(n)]).sum(0)
            assert torch.allclose(summed, want, atol=1e-10)


@pytest.mark.parametrize("n,causal", [(2, True), (4, True), (4, False)])
def test_ring_attention_equals_the_whole_kernel(n: int, causal: bool) -> None:
    (q, k, v, grad, out, lse), (w_out, w_lse, w_dq, w_dk, w_dv) = _whole(causal)
    with local_ranks(n):
        mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("cp",))
        seq = lambda t: distribute_tensor(t, mesh, [Shard(2)]).to_local()  # noqa: E731
        o, l = ring_attention.forward(FWD, seq(q), seq(k), seq(v), mesh, 0, causal, {})
        _check(o, w_out, mesh, Shard(2))
        _check(l, w_lse, mesh, Shard(2))
        grads = ring_attention.backward(BWD, seq(grad), seq(q), seq(k), seq(v), seq(out), seq(lse), mesh, 0, causal, {})
        for got, want in zip(grads, (w_dq, w_dk, w_dv)):
            _check(got, want, mesh, Shard(2))
