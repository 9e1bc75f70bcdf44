"""Causal attention on a sequence shard of the queries, load-balanced (context parallelism, ``rules/attention``).

The ``n`` ranks of a mesh axis hold contiguous query chunks. Causally, the chunk of rank ``r`` sees ``(r+1)/n``
of the keys, so the last rank would do twice the mean work. Here every chunk is cut in two halves (``2n`` along
the sequence): rank ``r`` keeps its first half (half ``2r``) and exchanges its second half with its mirror rank
``n-1-r``, whose second half is half ``2n-1-2r``. Each rank then works on halves ``i`` and ``2n-1-i``, which
together see ``2n`` half-blocks of keys on every rank: the same causal area (Llama 3's and torchtitan's balanced
chunks, reached by a point-to-point swap of half a chunk instead of reordering the data). The borrowed half's
output goes back to its owner, so the op's inputs and outputs keep the plain contiguous ``Shard`` of DTensor.

A half of ``c`` queries starting at ``s`` runs in two kernel calls: the keys before it (``[0, s)``), unmasked,
and its own diagonal block (``[s, s+c)``), causal (a square, so the kernel's top-left causal mask is the right
one); the two are merged by their log-sum-exp. The backward runs the same pieces through the kernel's backward
with the merged output and log-sum-exp (a flash backward is exact per key block given those), sums the pieces'
query gradients and places their key and value gradients at their keys: each rank's share (``Partial``).

What it sends, per device, for the cost model (``exchanged_bytes``): half the local queries, output and
log-sum-exp forward; half the output gradient, queries, output and log-sum-exp, and the query gradient back,
backward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from autoshard import _torch_compat as tc
from autoshard.rules.sdpa_kernels import Kernel

_SEQ = 2  # [B, H, T, D] and the log-sum-exp [B, H, T]


def halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    c = t.shape[_SEQ] // 2
    return t.narrow(_SEQ, 0, c), t.narrow(_SEQ, c, t.shape[_SEQ] - c)


def like(t: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` in ``t``'s memory layout: the kernel lays its output out as its query (a query transposed from
    ``[B, T, H, D]`` gives an output a later ``view`` reads as ``[B, T, H*D]``), and its gradients as their inputs."""
    return value if value.stride() == t.stride() else torch.empty_like(t, dtype=value.dtype).copy_(value)


def lse_like(q: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """A log-sum-exp accumulator in the kernel's own dtype: float32, float64 for float64 queries."""
    return lse if q.dtype == torch.float64 else lse.to(torch.float32)


def half_starts(r: int, n: int, c: int) -> tuple[int, int]:
    """Sequence offsets of rank ``r``'s own first half and of the half it borrows from its mirror rank."""
    return 2 * r * c, (2 * n - 1 - 2 * r) * c


_Acc = tuple[torch.Tensor, torch.Tensor]  # running (output, log-sum-exp), in ``acc_dtype``


def blocks(q_start: int, c: int, j: int, chunk: int, causal: bool) -> list[tuple[int, int, bool]]:
    """The (offset, length, causal) key ranges of key chunk ``j`` (``chunk`` keys) that queries
    ``[q_start, q_start + c)`` attend: the keys before them in full, their own diagonal block causally (a
    square: the kernel's top-left causal mask is the right one), none after them."""
    if not causal:
        return [(0, chunk, False)]
    k0 = j * chunk
    out = []
    before = min(k0 + chunk, q_start) - k0
    if before > 0:
        out.append((0, before, False))
    if k0 <= q_start < k0 + chunk:
        out.append((q_start - k0, c, True))
    return out


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """Accumulators: float32 at least (bf16 inputs), the inputs' own where wider."""
    return torch.promote_types(t.dtype, torch.float32)


def fresh(parts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Empty accumulators for query tensors ``parts``, flat: (output 0, log-sum-exp -inf) per part."""
    dtype = acc_dtype(parts[0])
    return tuple(
        t
        for p in parts
        for t in (
            torch.zeros(p.shape, dtype=dtype, device=p.device),
            torch.full(p.shape[:-1], float("-inf"), dtype=dtype, device=p.device),
        )
    )


def _merge(acc: _Acc, out: torch.Tensor, lse: torch.Tensor) -> _Acc:
    out, lse = out.to(acc[0].dtype), lse.to(acc[1].dtype)
    total = torch.logaddexp(acc[1], lse)
    merged = acc[0] * torch.exp(acc[1] - total).unsqueeze(-1) + out * torch.exp(lse - total).unsqueeze(-1)
    return merged, total


def forward_step(
    kernel: Kernel,
    qs: Sequence[torch.Tensor],
    starts: Sequence[int],
    k: torch.Tensor,
    v: torch.Tensor,
    j: int,
    causal: bool,
    flat: Sequence[torch.Tensor],
    kw: Mapping[str, Any],
) -> tuple[torch.Tensor, ...]:
    """Queries ``qs`` (starting at ``starts``) against key chunk ``j``, merged into the accumulators ``flat``
    (``fresh``'s layout: per-rank results are combined one level deep, so they stay flat)."""
    out = []
    for i, (q, s) in enumerate(zip(qs, starts)):
        acc = (flat[2 * i], flat[2 * i + 1])
        for off, length, diag in blocks(s, q.shape[_SEQ], j, k.shape[_SEQ], causal):
            o, lse = kernel.forward(q, k.narrow(_SEQ, off, length), v.narrow(_SEQ, off, length), diag, kw)
            acc = _merge(acc, o, lse)
        out.extend(acc)
    return tuple(out)


def backward_step(
    kernel: Kernel,
    sides: Sequence[tuple[torch.Tensor, ...]],
    starts: Sequence[int],
    k: torch.Tensor,
    v: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    dqs: Sequence[torch.Tensor],
    j: int,
    causal: bool,
    kw: Mapping[str, Any],
) -> tuple[torch.Tensor, ...]:
    """The gradients of :func:`forward_step`'s pieces, given the merged output and log-sum-exp in ``sides``
    (grad_out, query, out, logsumexp per query part; a flash backward is exact per key block given those):
    (dk, dv, dq per part), added to the accumulators ``dk``, ``dv``, ``dqs``."""
    new_dq = []
    for (g, q, o, lse), s, dq in zip(sides, starts, dqs):
        for off, length, diag in blocks(s, q.shape[_SEQ], j, k.shape[_SEQ], causal):
            a, b, c = kernel.backward(g, q, k.narrow(_SEQ, off, length), v.narrow(_SEQ, off, length), o, lse, diag, kw)[
                :3
            ]
            pad = (0, 0, off, k.shape[_SEQ] - off - length)
            dq = dq + a.to(dq.dtype)
            dk = dk + torch.nn.functional.pad(b.to(dk.dtype), pad)
            dv = dv + torch.nn.functional.pad(c.to(dv.dtype), pad)
        new_dq.append(dq)
    return (dk, dv, *new_dq)


def _forward_pair(
    kernel: Kernel,
    qa: torch.Tensor,
    qp: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    r: int,
    n: int,
    flat: Sequence[torch.Tensor],
    kw: Mapping[str, Any],
) -> tuple[torch.Tensor, ...]:
    # the whole keys and values are chunk 0 of one chunk
    return forward_step(kernel, (qa, qp), half_starts(r, n, qa.shape[_SEQ]), k, v, 0, True, flat, kw)


def _backward_pair(
    kernel: Kernel,
    a: tuple[torch.Tensor, ...],
    p: tuple[torch.Tensor, ...],
    k: torch.Tensor,
    v: torch.Tensor,
    r: int,
    n: int,
    kw: Mapping[str, Any],
) -> tuple[torch.Tensor, ...]:
    dtype = acc_dtype(a[1])
    zeros = [torch.zeros(t.shape, dtype=dtype, device=t.device) for t in (k, v, a[1], p[1])]
    return backward_step(kernel, (a, p), half_starts(r, n, a[1].shape[_SEQ]), k, v, *zeros[:2], zeros[2:], 0, True, kw)


def balanced(q_len: int, n: int) -> bool:
    """Whether a local chunk of ``q_len`` queries on an axis of ``n`` ranks can be balanced (two equal halves)."""
    return n > 1 and q_len % 2 == 0


def forward(
    kernel: Kernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mesh: DeviceMesh,
    axis: int,
    kw: Mapping[str, Any],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, logsumexp) of this rank's query chunk ``q`` (local, contiguous chunk ``r`` of ``n`` on ``axis``)
    against the whole causal ``k``/``v``, on ``kernel`` (``sdpa_kernels``); ``kw``: its keyword arguments (scale)."""
    n, r = mesh.size(axis), mesh.get_local_rank(axis)
    qa, qb = halves(q)
    qp = tc.swap_mirrored(qb.contiguous(), mesh, axis)
    oa, la, op_, lp = tc.for_each_rank(_forward_pair)(kernel, qa, qp, k, v, r, n, fresh((qa, qp)), kw)
    ob, lb = tc.swap_mirrored(op_.contiguous(), mesh, axis), tc.swap_mirrored(lp.contiguous(), mesh, axis)
    return like(q, torch.cat([oa, ob], _SEQ).to(q.dtype)), lse_like(q, torch.cat([la, lb], _SEQ))


def backward(
    kernel: Kernel,
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mesh: DeviceMesh,
    axis: int,
    kw: Mapping[str, Any],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of :func:`forward`: dq this rank's chunk, dk/dv whole but only this rank's queries' share."""
    n, r = mesh.size(axis), mesh.get_local_rank(axis)
    split = [halves(t) for t in (grad_out, q, out, lse)]
    own = tuple(h[0] for h in split)
    borrowed = tuple(tc.swap_mirrored(h[1].contiguous(), mesh, axis) for h in split)
    dk, dv, dqa, dqp = tc.for_each_rank(_backward_pair)(kernel, own, borrowed, k, v, r, n, kw)
    dqb = tc.swap_mirrored(dqp.contiguous(), mesh, axis)
    return like(q, torch.cat([dqa, dqb], _SEQ).to(q.dtype)), like(k, dk.to(k.dtype)), like(v, dv.to(v.dtype))


def exchanged_bytes(backward_op: bool, local_bytes: Mapping[str, int]) -> int:
    """Bytes one device sends its mirror rank in one call; ``local_bytes``: the local (sharded) sizes of
    ``query``, ``out`` and ``logsumexp``."""
    q, o, lse = local_bytes["query"], local_bytes["out"], local_bytes["logsumexp"]
    return (o + q + o + lse + q) // 2 if backward_op else (q + o + lse) // 2


__all__ = [
    "acc_dtype",
    "backward",
    "backward_step",
    "balanced",
    "blocks",
    "exchanged_bytes",
    "forward",
    "forward_step",
    "fresh",
    "half_starts",
    "halves",
    "like",
    "lse_like",
]
