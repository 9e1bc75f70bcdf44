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

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from autoshard import _torch_compat as tc

_SEQ = 2  # [B, H, T, D] and the log-sum-exp [B, H, T]


def halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    c = t.shape[_SEQ] // 2
    return t.narrow(_SEQ, 0, c), t.narrow(_SEQ, c, t.shape[_SEQ] - c)


def like(t: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` in ``t``'s memory layout: the kernel lays its output out as its query (a query transposed from
    ``[B, T, H, D]`` gives an output a later ``view`` reads as ``[B, T, H*D]``), and its gradients as their inputs."""
    return value if value.stride() == t.stride() else torch.empty_like(t, dtype=value.dtype).copy_(value)


def half_starts(r: int, n: int, c: int) -> tuple[int, int]:
    """Sequence offsets of rank ``r``'s own first half and of the half it borrows from its mirror rank."""
    return 2 * r * c, (2 * n - 1 - 2 * r) * c


def _attend(op: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
            kw: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    c = q.shape[_SEQ]
    diag = op(q, k.narrow(_SEQ, start, c), v.narrow(_SEQ, start, c), 0.0, True, **kw)
    if start == 0:
        return diag[0], diag[1]
    before = op(q, k.narrow(_SEQ, 0, start), v.narrow(_SEQ, 0, start), 0.0, False, **kw)
    lse = torch.logaddexp(diag[1], before[1])
    out = sum(o.float() * torch.exp(part - lse).unsqueeze(-1) for o, part in ((diag[0], diag[1]), (before[0], before[1])))
    return out.to(q.dtype), lse


def _grads(op: Any, g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
           lse: torch.Tensor, start: int, kw: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    c = q.shape[_SEQ]
    dq, dk, dv = op(g, q, k.narrow(_SEQ, start, c), v.narrow(_SEQ, start, c), out, lse, 0.0, True, **kw)[:3]
    pad = (0, 0, start, k.shape[_SEQ] - start - c)
    dk_full, dv_full = torch.nn.functional.pad(dk, pad), torch.nn.functional.pad(dv, pad)
    if start > 0:
        dq_b, dk_b, dv_b = op(g, q, k.narrow(_SEQ, 0, start), v.narrow(_SEQ, 0, start), out, lse, 0.0, False, **kw)[:3]
        rest = (0, 0, 0, k.shape[_SEQ] - start)
        dq = dq + dq_b
        dk_full = dk_full + torch.nn.functional.pad(dk_b, rest)
        dv_full = dv_full + torch.nn.functional.pad(dv_b, rest)
    return dq, dk_full, dv_full


def _forward_pair(op: Any, qa: torch.Tensor, qp: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r: int, n: int,
                  kw: Mapping[str, Any]) -> tuple[torch.Tensor, ...]:
    own, borrowed = half_starts(r, n, qa.shape[_SEQ])
    return (*_attend(op, qa, k, v, own, kw), *_attend(op, qp, k, v, borrowed, kw))


def _backward_pair(op: Any, a: tuple[torch.Tensor, ...], p: tuple[torch.Tensor, ...], k: torch.Tensor,
                   v: torch.Tensor, r: int, n: int, kw: Mapping[str, Any]) -> tuple[torch.Tensor, ...]:
    own, borrowed = half_starts(r, n, a[1].shape[_SEQ])
    dqa, dka, dva = _grads(op, a[0], a[1], k, v, a[2], a[3], own, kw)
    dqp, dkp, dvp = _grads(op, p[0], p[1], k, v, p[2], p[3], borrowed, kw)
    return dqa, dqp, dka + dkp, dva + dvp


def balanced(q_len: int, n: int) -> bool:
    """Whether a local chunk of ``q_len`` queries on an axis of ``n`` ranks can be balanced (two equal halves)."""
    return n > 1 and q_len % 2 == 0


def forward(op: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: DeviceMesh, axis: int,
            kw: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, logsumexp) of this rank's query chunk ``q`` (local, contiguous chunk ``r`` of ``n`` on ``axis``)
    against the whole causal ``k``/``v``; ``op`` is the CPU flash kernel, ``kw`` its keyword arguments (scale)."""
    n, r = mesh.size(axis), mesh.get_local_rank(axis)
    qa, qb = halves(q)
    qp = tc.swap_mirrored(qb.contiguous(), mesh, axis)
    oa, la, op_, lp = tc.for_each_rank(_forward_pair)(op, qa, qp, k, v, r, n, kw)
    ob, lb = tc.swap_mirrored(op_.contiguous(), mesh, axis), tc.swap_mirrored(lp.contiguous(), mesh, axis)
    return like(q, torch.cat([oa, ob], _SEQ)), torch.cat([la, lb], _SEQ)


def backward(op: Any, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, mesh: DeviceMesh, axis: int,
             kw: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of :func:`forward`: dq this rank's chunk, dk/dv whole but only this rank's queries' share."""
    n, r = mesh.size(axis), mesh.get_local_rank(axis)
    split = [halves(t) for t in (grad_out, q, out, lse)]
    own = tuple(h[0] for h in split)
    borrowed = tuple(tc.swap_mirrored(h[1].contiguous(), mesh, axis) for h in split)
    dqa, dqp, dk, dv = tc.for_each_rank(_backward_pair)(op, own, borrowed, k, v, r, n, kw)
    dqb = tc.swap_mirrored(dqp.contiguous(), mesh, axis)
    return like(q, torch.cat([dqa, dqb], _SEQ)), like(k, dk), like(v, dv)


def exchanged_bytes(backward_op: bool, local_bytes: Mapping[str, int]) -> int:
    """Bytes one device sends its mirror rank in one call; ``local_bytes``: the local (sharded) sizes of
    ``query``, ``out`` and ``logsumexp``."""
    q, o, lse = local_bytes["query"], local_bytes["out"], local_bytes["logsumexp"]
    return (o + q + o + lse + q) // 2 if backward_op else (q + o + lse) // 2


__all__ = ["backward", "balanced", "exchanged_bytes", "forward", "half_starts", "halves", "like"]
