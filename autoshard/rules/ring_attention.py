"""Ring attention: queries, keys and values all sequence-sharded on one mesh axis (``rules/attention``'s "ring").

Each of the ``n`` ranks keeps its contiguous chunk of keys and values and passes it to the next rank, ``n - 1``
times, so every query chunk meets every key chunk without any rank holding them all (Liu et al.'s ring
attention). Each step's partial results merge into the running output by their log-sum-exp (the online
softmax). Sends are issued before the step's kernels and read after them, so the transfer of the next chunk
overlaps the current chunk's compute (asynchronous where the backend is).

Causal attention keeps ``causal_chunks``' balance: each rank works on its own first half-chunk and its mirror
rank's second half, and a half of ``c`` queries starting at ``s`` meets the key half-blocks before it in full,
its own diagonally, and skips the ones after it. The backward passes the key and value chunks around again,
with their gradients travelling alongside: each rank adds its queries' share as a chunk passes, and after the
last step one more send brings every chunk's gradient home (whole, not ``Partial``).

What it sends per device, for the cost model (``exchanged``): the key and value chunks ``n - 1`` times forward;
backward the chunks ``n - 1`` times and their gradients ``n`` times; causal attention adds the half-chunk swap.
The chunk sends overlap compute; the swap does not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from autoshard import _torch_compat as tc
from autoshard.rules.causal_chunks import (
    acc_dtype,
    backward_step,
    forward_step,
    fresh,
    half_starts,
    halves,
    like,
    lse_like,
)
from autoshard.rules.sdpa_kernels import Kernel

_SEQ = 2


def _queries(ts: Sequence[torch.Tensor], mesh: DeviceMesh, axis: int, causal: bool) -> tuple[list, ...]:
    """The query-side tensors this rank works on: causal, its own first halves and its mirror rank's second
    halves (``causal_chunks``); otherwise its chunk as it is."""
    if not causal:
        return ([t for t in ts],)
    split = [halves(t) for t in ts]
    return [h[0] for h in split], [tc.swap_mirrored(h[1].contiguous(), mesh, axis) for h in split]


def _starts_of(r: int, n: int, chunk: int, causal: bool) -> tuple[int, ...]:
    return half_starts(r, n, chunk // 2) if causal else (r * chunk,)


def forward(
    kernel: Kernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mesh: DeviceMesh,
    axis: int,
    causal: bool,
    kw: Mapping[str, Any],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, logsumexp) of this rank's chunk of ``q`` against every chunk of ``k``/``v`` (all local chunks)."""
    n, r = mesh.size(axis), mesh.get_local_rank(axis)
    nxt = [(c + 1) % n for c in range(n)]
    parts = [p[0] for p in _queries([q], mesh, axis, causal)]
    flat = fresh(parts)
    chunk = k.shape[_SEQ]
    for step in range(n):
        sent = (
            (tc.permute_on_axis(k, mesh, axis, nxt), tc.permute_on_axis(v, mesh, axis, nxt)) if step < n - 1 else None
        )
        flat = tc.for_each_rank(_step_forward)(kernel, parts, k, v, r, n, step, chunk, causal, flat, kw)
        if sent is not None:
            k, v = tc.waited(sent[0]), tc.waited(sent[1])
    outs = [o.to(q.dtype) for o in flat[0::2]]
    lses = [lse_like(q, t) for t in flat[1::2]]
    if causal:  # the borrowed half's results go back to their owner
        outs[1], lses[1] = (
            tc.swap_mirrored(outs[1].contiguous(), mesh, axis),
            tc.swap_mirrored(lses[1].contiguous(), mesh, axis),
        )
    return like(q, torch.cat(outs, _SEQ)), torch.cat(lses, _SEQ)


def _step_forward(
    kernel: Kernel,
    parts: Sequence[torch.Tensor],
    k: torch.Tensor,
    v: torch.Tensor,
    r: int,
    n: int,
    step: int,
    chunk: int,
    causal: bool,
    flat: Sequence[torch.Tensor],
    kw: Mapping[str, Any],
) -> tuple[torch.Tensor, ...]:
    starts = _starts_of(r, n, 2 * parts[0].shape[_SEQ] if causal else chunk, causal)
    return forward_step(kernel, parts, starts, k, v, (r - step) % n, causal, flat, kw)


def _step_backward(
    kernel: Kernel,
    sides: Sequence[tuple[torch.Tensor, ...]],
    k: torch.Tensor,
    v: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    dqs: Sequence[torch.Tensor],
    r: int,
    n: int,
    step: int,
    causal: bool,
    kw: Mapping[str, Any],
) -> tuple[torch.Tensor, ...]:
    q_len = sides[0][1].shape[_SEQ]
    starts = _starts_of(r, n, 2 * q_len if causal else k.shape[_SEQ], causal)
    return backward_step(kernel, sides, starts, k, v, dk, dv, dqs, (r - step) % n, causal, kw)


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
    causal: bool,
    kw: Mapping[str, Any],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of :func:`forward`, each this rank's chunk."""
    n, r = mesh.size(axis), mesh.get_local_rank(axis)
    nxt = [(c + 1) % n for c in range(n)]
    sides = [tuple(side) for side in _queries([grad_out, q, out, lse], mesh, axis, causal)]
    acc = acc_dtype(q)
    dqs = tuple(torch.zeros(h[1].shape, dtype=acc, device=h[1].device) for h in sides)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)  # the travelling gradients, summed in fp32 at least
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for step in range(n):
        sent = (
            (tc.permute_on_axis(k, mesh, axis, nxt), tc.permute_on_axis(v, mesh, axis, nxt)) if step < n - 1 else None
        )
        dk, dv, *rest = tc.for_each_rank(_step_backward)(kernel, sides, k, v, dk, dv, dqs, r, n, step, causal, kw)
        dqs = tuple(rest)
        dk, dv = tc.permute_on_axis(dk, mesh, axis, nxt), tc.permute_on_axis(dv, mesh, axis, nxt)
        if sent is not None:
            k, v = tc.waited(sent[0]), tc.waited(sent[1])
    dqs = [d.to(q.dtype) for d in dqs]
    if causal:
        dqs[1] = tc.swap_mirrored(dqs[1].contiguous(), mesh, axis)
    return like(q, torch.cat(dqs, _SEQ)), like(k, tc.waited(dk).to(k.dtype)), like(v, tc.waited(dv).to(v.dtype))


def exchanged(backward_op: bool, causal: bool, n: int, local_bytes: Mapping[str, int]) -> list[tuple[str, int]]:
    """[(kind, bytes)], one entry per message a device sends in one call: "overlapped" for each step's chunk
    sends (one latency each), "point_to_point" for the half swap; ``local_bytes``: the local sizes of
    ``query``, ``key``, ``value``, ``out`` and ``logsumexp``."""
    q, k, v, o, lse = (local_bytes[x] for x in ("query", "key", "value", "out", "logsumexp"))
    steps = [("overlapped", k + v)] * (n - 1)
    if backward_op:  # the chunks again, with their gradients (one more send to bring them home)
        steps = [("overlapped", 2 * (k + v))] * (n - 1) + [("overlapped", k + v)]
    swap = ((o + q + o + lse + q) // 2 if backward_op else (q + o + lse) // 2) if causal else 0
    return steps + ([("point_to_point", swap)] if swap else [])


__all__ = ["backward", "exchanged", "forward"]
