"""Context-parallel attention kernels against the single-device kernel, forward and backward.

``autoshard/rules/causal_chunks.py`` (query chunks against gathered keys and values, balanced by swapping
half-chunks with the mirror rank) and ``autoshard/rules/ring_attention.py`` (keys and values passed around a
ring, merged by log-sum-exp) on 2 and 4 simulated ranks: each rank's output, log-sum-exp and gradients equal the
slices of the whole-sequence kernel's (float64, GQA: 4 query heads on 2 key/value heads)."""

from __future__ import annotations

import pytest
import torch
from harness import local_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from autoshard.rules import causal_chunks, ring_attention
from autoshard.rules.sdpa_kernels import KERNELS

CPU = KERNELS[0]
FWD, BWD = CPU.op(False), CPU.op(True)


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
        o, lse_piece = causal_chunks.forward(CPU, seq(q), rep(k), rep(v), mesh, 0, {})
        _check(o, w_out, mesh, Shard(2))
        _check(lse_piece, w_lse, mesh, Shard(2))
        dq, dk, dv = causal_chunks.backward(CPU, seq(grad), seq(q), rep(k), rep(v), seq(out), seq(lse), mesh, 0, {})
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
        o, lse_piece = ring_attention.forward(CPU, seq(q), seq(k), seq(v), mesh, 0, causal, {})
        _check(o, w_out, mesh, Shard(2))
        _check(lse_piece, w_lse, mesh, Shard(2))
        grads = ring_attention.backward(CPU, seq(grad), seq(q), seq(k), seq(v), seq(out), seq(lse), mesh, 0, causal, {})
        for got, want in zip(grads, (w_dq, w_dk, w_dv)):
            _check(got, want, mesh, Shard(2))


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", [k.name for k in KERNELS])
def test_each_kernels_pieces_equal_its_whole_call(name: str, causal: bool) -> None:
    """Context parallelism's pieces on every kernel SDPA may run (``sdpa_kernels``): each of 4 ranks' query
    chunk (causal: its balanced pair of half-chunks) against every key chunk, one kernel call per block, merged
    by log-sum-exp, forward and backward, equal to one call of the same kernel on the whole sequence; and that
    call equal to ``F.scaled_dot_product_attention`` forced onto the kernel. The CUDA kernels run in bf16 on a
    GPU (skipped without one), the CPU kernel in float64. 160 keys per chunk and 80 per half: the efficient
    kernel's log-sum-exp is padded to 96."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernel = next(k for k in KERNELS if k.name == name)
    if name != "cpu" and not torch.cuda.is_available():
        pytest.skip("a CUDA kernel: needs a GPU")
    device, dtype, tol = ("cpu", torch.float64, 1e-10) if name == "cpu" else ("cuda", torch.bfloat16, 2e-2)
    n, t = 4, 640
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, grad = (torch.randn(2, 4, t, 64, dtype=dtype, device=device, generator=g) for _ in range(4))
    out, lse = kernel.forward(q, k, v, causal, {})
    dq, dk, dv = kernel.backward(grad, q, k, v, out, lse, causal, {})[:3]
    backend = {
        "cpu": SDPBackend.FLASH_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
    }[name]
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    with sdpa_kernel([backend]):
        ref = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
    ref.backward(grad)
    for got, want in zip((out, dq, dk, dv), (ref, *(x.grad for x in leaves))):
        assert _rel(got, want) < tol, (name, _rel(got, want))

    chunk = t // n
    kc, vc = k.split(chunk, 2), v.split(chunk, 2)
    got_out, got_lse, got_dq = torch.zeros_like(out), torch.zeros_like(lse), torch.zeros_like(dq)
    got_dk, got_dv = torch.zeros_like(dk, dtype=torch.float64), torch.zeros_like(dv, dtype=torch.float64)
    for r in range(n):
        starts = causal_chunks.half_starts(r, n, chunk // 2) if causal else (r * chunk,)
        size = chunk // 2 if causal else chunk
        parts = [q.narrow(2, s, size) for s in starts]
        flat = causal_chunks.fresh(parts)
        for j in range(n):
            flat = causal_chunks.forward_step(kernel, parts, starts, kc[j], vc[j], j, causal, flat, {})
        for i, s in enumerate(starts):
            got_out.narrow(2, s, size).copy_(flat[2 * i])
            got_lse.narrow(2, s, size).copy_(flat[2 * i + 1])
        sides = [tuple(x.narrow(2, s, size) for x in (grad, q, out, lse)) for s in starts]
        dqs = [
            torch.zeros(p.shape, dtype=torch.float32 if dtype != torch.float64 else dtype, device=device) for p in parts
        ]
        for j in range(n):
            zero = torch.zeros(kc[j].shape, dtype=dqs[0].dtype, device=device)
            d_k, d_v, *dqs = causal_chunks.backward_step(
                kernel, sides, starts, kc[j], vc[j], zero, zero.clone(), dqs, j, causal, {}
            )
            got_dk.narrow(2, j * chunk, chunk).add_(d_k)
            got_dv.narrow(2, j * chunk, chunk).add_(d_v)
        for s, d in zip(starts, dqs):
            got_dq.narrow(2, s, size).copy_(d)
    for what, got, want in (
        ("out", got_out, out),
        ("lse", got_lse, lse),
        ("dq", got_dq, dq),
        ("dk", got_dk, dk),
        ("dv", got_dv, dv),
    ):
        assert _rel(got, want) < tol, (name, what, _rel(got, want))
