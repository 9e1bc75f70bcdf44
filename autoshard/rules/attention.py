"""Scaled dot-product attention on CPU (``_scaled_dot_product_flash_attention_for_cpu`` and its backward).

DTensor has no strategy for the CPU kernel. Ours, per mesh axis: everything whole, every tensor sharded on the
batch or on the heads (attention is independent across both), or **context parallelism**: the queries, the
output and its log-sum-exp sharded on the sequence while the keys and values are whole on that axis (gathered
by the edge before the op: all-gathered K/V, as Llama 3 trains long sequences), the backward's key and value
gradients Partial (each rank's queries' share, summed by a reduce-scatter or all-reduce); or **ring
attention** (``ring_attention``): queries, keys, values and every output on their sequence chunk, the key and
value chunks passed around the ring inside the op, behind its compute. The cost model picks between them. An
input that broadcasts on a sharded dimension (a mask ``[B, 1, T, T]`` has one head) stays whole on it; with a
mask input the ring is not offered.

DTensor cannot run any of these, so the lowering calls the kernel on each rank's local shards. Causal
attention with the sequence sharded is load-balanced (``causal_chunks``): each rank's chunk is halved and the
second halves exchanged with the mirror rank, so every rank works on a balanced pair of half-chunks, in kernel
calls that skip the masked blocks; its FLOPs are then the causal half of its queries against every key, as the
planner prices it (the global causal count over the shards), and the exchanged halves are priced as
point-to-point messages (``exchanges``). The sequence is split on one mesh axis at most. Where the balanced
kernel cannot run (a mask given, dropout, an odd chunk) ``local_call`` falls back, with a warning, to the kernel
with an explicit mask built from the rank's query positions (the chunk of ``arange(T)`` the queries' own
placement gives it), which does its full unmasked share. FLOPs: the kernel's matmuls (torch's counter knows
only the CUDA ones).
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autoshard import _torch_compat as tc
from autoshard.ir import NodeSharding, output_vals, tensor_args
import autoshard.rules.causal_chunks as causal_chunks
import autoshard.rules.ring_attention as ring_attention
from autoshard.rules.base import OpRule
from autoshard.errors import InputError
from autoshard.messages import warn

logger = logging.getLogger(__name__)

_Shape = Sequence[int]
_SEQ = 2  # [B, H, T, D]: the sequence dim of query, key, value and output; logsumexp [B, H, T] has it too
# shorter sequences are not offered the sequence split: the option multiplies every attention group's candidates
# (planning time), and a chunk of a few dozen queries against gathered keys and values is not what CP is for
_MIN_SEQ = 256


def _ops() -> frozenset[Any]:
    aten = torch.ops.aten
    return frozenset({aten._scaled_dot_product_flash_attention_for_cpu.default,
                      aten._scaled_dot_product_flash_attention_for_cpu_backward.default})


def _is_backward(node: fx.Node) -> bool:
    return node.target is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _layout(option: str, backward: bool, n_in: int, n_out: int) -> tuple[list[Placement], list[Placement]]:
    """Per-tensor placements on one axis for ``option``: inputs in argument order, then outputs."""
    if option not in ("seq", "ring"):
        p = {"whole": Replicate(), "batch": Shard(0), "heads": Shard(1)}[option]
        return [p] * n_in, [p] * n_out
    s, r = Shard(_SEQ), Replicate()
    if option == "ring":  # everything on its sequence chunk (no mask input: ``candidates``)
        return [s] * n_in, [s] * n_out
    if backward:  # grad_out, query, key, value, out, logsumexp[, mask] -> grad q, k, v
        return [s, s, r, r, s, s, s][:n_in], [s, Partial(), Partial()]
    return [s, r, r, s][:n_in], [s, s]  # query, key, value[, mask] -> output, logsumexp


def splits_sequence(node: fx.Node) -> bool:
    """Whether ``node`` (an attention op of this rule) is offered the sequence split (context parallelism)."""
    ins = [a.meta["val"] for a in tensor_args(node)]
    q, k = (ins[1], ins[2]) if _is_backward(node) else (ins[0], ins[1])
    return q.shape[_SEQ] == k.shape[_SEQ] and q.shape[_SEQ] >= _MIN_SEQ


def candidates(node: fx.Node, ties: Sequence[int]) -> list[tc.RawStrategy]:
    """Per distinct mesh axis (``ties``: axes that must place alike share one choice): whole, batch, heads, or
    the sequence (self-attention of at least ``_MIN_SEQ`` tokens), with keys and values gathered ("seq") or
    passed around a ring ("ring", ``ring_attention``); the sequence on one axis at most."""
    ins = [a.meta["val"] for a in tensor_args(node)]
    backward = _is_backward(node)
    q = ins[1] if backward else ins[0]
    outs = output_vals(node)
    n_tensors = 6 if backward else 3  # a mask input leaves the ring out (its blocks would need slicing too)
    options = ["whole", "batch", "heads"] + (["seq"] if splits_sequence(node) else []) + (
        ["ring"] if splits_sequence(node) and len(ins) == n_tensors else [])
    free = sorted(set(ties))

    def fit(p: Placement, v: torch.Tensor) -> Placement:
        return Replicate() if isinstance(p, Shard) and v.shape[p.dim] == 1 < q.shape[p.dim] else p

    causal = _causal(node)
    result = []
    for sub in itertools.product(options, repeat=len(free)):
        pick = dict(zip(free, sub))
        along = [pick[t] for t in ties if pick[t] in ("seq", "ring")]
        if len(along) > 1 and (causal or "ring" in along):
            continue  # the balanced causal kernel and the ring exchange chunks along one axis
        per_axis = [_layout(pick[t], backward, len(ins), len(outs)) for t in ties]
        in_pl = tuple(tuple(fit(ax[0][i], v) for ax in per_axis) for i, v in enumerate(ins))
        out_pl = tuple(tuple(ax[1][j] for ax in per_axis) if o is not None else None for j, o in enumerate(outs))
        result.append(tc.RawStrategy(in_pl, out_pl))
    return result


def runs_local(node: fx.Node, sharding: NodeSharding) -> bool:
    return True  # batch, heads and query chunks are independent: each rank's kernel on its shards


def _causal(node: fx.Node) -> bool:
    backward = _is_backward(node)
    at = 7 if backward else 4
    return bool(node.args[at]) if len(node.args) > at else bool(node.kwargs.get("is_causal", False))


def _seq_axes(placements: Sequence[Placement] | None) -> list[int]:
    return [a for a, p in enumerate(placements or ()) if isinstance(p, Shard) and p.dim == _SEQ]


def local_call(node: fx.Node, sharding: NodeSharding) -> Callable[[tuple, dict, DeviceMesh], Any] | None:
    """Causal attention whose queries are sequence-sharded: the load-balanced kernel (``causal_chunks``), or
    where it cannot run (a mask given, dropout, an odd chunk) the kernel with this rank's causal mask, with a
    warning; else None (the kernel as traced, on local shards)."""
    backward = _is_backward(node)
    q_pl = sharding.inputs[1 if backward else 0]
    ring = _seq_axes(sharding.inputs[2 if backward else 1])
    if ring:
        return _ring_call(node, ring[0])
    if not _causal(node) or not _seq_axes(q_pl):
        return None
    warned = []

    def call(args: tuple, kwargs: dict, mesh: DeviceMesh) -> Any:
        local = [a.to_local() if hasattr(a, "to_local") else a for a in args]
        given = kwargs.get("attn_mask")
        rest = {key: v for key, v in kwargs.items() if key not in ("attn_mask", "is_causal")}
        dropout = local[6 if backward else 3] if len(local) > (6 if backward else 3) else 0.0
        axes = _seq_axes(q_pl)
        q_len = local[1 if backward else 0].shape[_SEQ]
        if len(axes) == 1 and given is None and not dropout and causal_chunks.balanced(q_len, mesh.size(axes[0])):
            if backward:
                return causal_chunks.backward(node.target, *local[:6], mesh, axes[0], rest)
            return causal_chunks.forward(node.target, *local[:3], mesh, axes[0], rest)
        if not warned:
            warned.append(True)
            warn(logger, "%s: causal attention on a sequence shard runs unbalanced (a full chunk of work on every "
                           "rank, twice the planned): %s", node.name,
                           "a mask is given" if given is not None else "dropout" if dropout else
                           f"{q_len} local queries on mesh axes {axes} (one axis and an even chunk balance)")
        q, k = (args[1], args[2]) if backward else (args[0], args[1])
        t = k.shape[_SEQ]
        full = torch.arange(t, device=k.to_local().device)
        chunks = [Shard(0) if isinstance(p, Shard) and p.dim == _SEQ else Replicate() for p in q_pl]
        whole = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
        pos = tc.redistribute(whole, mesh, chunks).to_local()  # this rank's query positions (no communication)
        mask = torch.zeros(pos.shape[0], t, dtype=q.dtype, device=full.device)
        mask = mask.masked_fill(full[None, :] > pos[:, None], float("-inf"))[None, None]
        if given is not None:
            mask = mask + (given.to_local() if hasattr(given, "to_local") else given)
        if backward:  # (grad_out, query, key, value, out, logsumexp, dropout_p, is_causal)
            return node.target(*local[:7], False, attn_mask=mask, **rest)
        return node.target(*local[:3], dropout, False, attn_mask=mask, **rest)

    return call


def _ring_call(node: fx.Node, axis: int) -> Callable[[tuple, dict, DeviceMesh], Any]:
    backward, causal = _is_backward(node), _causal(node)

    def call(args: tuple, kwargs: dict, mesh: DeviceMesh) -> Any:
        local = [a.to_local() if hasattr(a, "to_local") else a for a in args]
        rest = {key: v for key, v in kwargs.items() if key not in ("attn_mask", "is_causal")}
        q_len = local[1 if backward else 0].shape[_SEQ]
        dropout = local[6 if backward else 3] if len(local) > (6 if backward else 3) else 0.0
        if dropout or (causal and not causal_chunks.balanced(q_len, mesh.size(axis))):
            raise InputError(f"{node.name} ({node.target}): ring attention over mesh axis {axis} (size "
                             f"{mesh.size(axis)}) needs no dropout and, causal, an even chunk ({q_len} queries per "
                             "rank); make the sequence a multiple of twice the axis size, or constrain attention's "
                             "inputs off the sequence")
        if backward:
            return ring_attention.backward(node.target, *local[:6], mesh, axis, causal, rest)
        return ring_attention.forward(node.target, *local[:3], mesh, axis, causal, rest)

    return call


def exchanges(node: fx.Node, inputs: Sequence[Sequence[Placement] | None],
              mesh_shape: Sequence[int]) -> list[tuple[str, int, int]]:
    """("point_to_point", mesh axis, bytes per device) the load-balanced causal kernel sends its mirror rank at these input
    placements (``causal_chunks``): priced as point-to-point messages next to the kernel."""
    backward = _is_backward(node)
    q_pl = inputs[1 if backward else 0]
    axes = [a for a in _seq_axes(q_pl) if mesh_shape[a] > 1]
    if len(axes) != 1 or (not _causal(node) and not _seq_axes(inputs[2 if backward else 1])):
        return []
    shard = math.prod(n for p, n in zip(q_pl, mesh_shape) if isinstance(p, Shard))
    vals = [a.meta["val"] for a in tensor_args(node)]
    q, k, v, out, lse = (*vals[1:4], vals[4], vals[5]) if backward else (*vals[:3], *output_vals(node)[:2])
    local = {name: t.numel() * t.element_size() // shard
             for name, t in (("query", q), ("key", k), ("value", v), ("out", out), ("logsumexp", lse))}
    if _seq_axes(inputs[2 if backward else 1]):  # the ring
        return [(kind, axes[0], b) for kind, b in
                ring_attention.exchanged(backward, _causal(node), mesh_shape[axes[0]], local)]
    return [("point_to_point", axes[0], causal_chunks.exchanged_bytes(backward, local))]


def _dims(query: _Shape, key: _Shape, value: _Shape) -> tuple[int, int, int, int, int]:
    """(B*Hq, Lq, Lk, Dq, Dv) from [B, H, L, D] shapes; key/value may have fewer heads (GQA), the kernel
    broadcasts them, so the work follows the query's heads."""
    *batch, lq, dq = query
    lk, dv = key[-2], value[-1]
    return math.prod(batch), lq, lk, dq, dv


def _forward_flops(query: _Shape, key: _Shape, value: _Shape, *rest: Any, is_causal: bool = False, **_: Any) -> int:
    # Two matmuls: scores = q @ k^T (2*Lq*Lk*Dq per head) and out = p @ v (2*Lq*Lk*Dv); = 4*B*H*Lq*Lk*D when
    # Dq == Dv. Positional signature: (query, key, value, dropout_p=0., is_causal=False). The causal kernel
    # skips the masked upper triangle. (The planner counts on global shapes and divides by the shards; a
    # sequence shard of the queries, fewer queries than keys, is then the balanced causal share.)
    if len(rest) >= 2:
        is_causal = bool(rest[1])
    bh, lq, lk, dq, dv = _dims(query, key, value)
    flops = 2 * bh * lq * lk * (dq + dv)
    return flops // 2 if is_causal and lq == lk else flops


def _backward_flops(grad_out: _Shape, query: _Shape, key: _Shape, value: _Shape, *rest: Any,
                    is_causal: bool = False, **_: Any) -> int:
    # Five matmuls, as torch counts the CUDA flash backward: recompute q @ k^T, dP = dO @ v^T, dV = P^T @ dO,
    # dQ = dS @ k, dK = dS^T @ q -> 2*Lq*Lk*(3*Dq + 2*Dv) per head = 2.5x the forward when Dq == Dv.
    # Positional signature: (grad_out, query, key, value, out, logsumexp, dropout_p, is_causal).
    if len(rest) >= 4:
        is_causal = bool(rest[3])
    bh, lq, lk, dq, dv = _dims(query, key, value)
    flops = 2 * bh * lq * lk * (3 * dq + 2 * dv)
    return flops // 2 if is_causal and lq == lk else flops


def _flops() -> Mapping[Any, Callable[..., int]]:
    aten = torch.ops.aten
    return {aten._scaled_dot_product_flash_attention_for_cpu.default: _forward_flops,
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _backward_flops}


RULE = OpRule("cpu attention", _ops, candidates=candidates, runs_local=runs_local, flops=_flops,
              local_call=local_call, exchanges=exchanges)
