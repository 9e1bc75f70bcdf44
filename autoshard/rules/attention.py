"""Scaled dot-product attention's fused kernels: CPU flash, CUDA flash, efficient and cuDNN (``sdpa_kernels``).

DTensor has no strategy for the CPU kernel and only batch and head ones for the CUDA kernels. Ours, for all
four alike (each call's arguments and outputs read by their role, ``sdpa_kernels.roles``), per mesh axis:
everything whole, every tensor sharded on the batch or on the heads (attention is independent across both), or
**context parallelism**: the queries, the output and its log-sum-exp sharded on the sequence while the keys
and values are whole on that axis (gathered by the edge before the op: all-gathered K/V, as Llama 3 trains long
sequences), the backward's key and value gradients Partial (each rank's queries' share, summed by a
reduce-scatter or all-reduce); or **ring attention** (``ring_attention``): queries, keys, values and every
output on their sequence chunk, the key and value chunks passed around the ring inside the op, behind its
compute. The cost model picks between them. An input that broadcasts on a sharded dimension (a mask
``[B, 1, T, T]`` has one head) stays whole on it; with a mask input or dropout the ring is not offered. The CUDA
kernels' extras (rng state, offsets) are whole on every rank.

DTensor cannot run any of these, so the lowering calls the kernel on each rank's local shards. Causal
attention with the sequence sharded is load-balanced (``causal_chunks``): each rank's chunk is halved and the
second halves exchanged with the mirror rank, so every rank works on a balanced pair of half-chunks, in kernel
calls that skip the masked blocks; its FLOPs are then the causal half of its queries against every key, as the
planner prices it (the global causal count over the shards), and the exchanged halves are priced as
point-to-point messages (``exchanges``). The sequence is split on one mesh axis at most. Where the balanced
kernel cannot run (a mask given, dropout, an odd chunk) the CPU kernel falls back, with a warning, to a call
with an explicit mask built from the rank's query positions (the chunk of ``arange(T)`` the queries' own
placement gives it), which does its full unmasked share; the CUDA kernels are not offered the sequence split
for causal attention with dropout, and an odd chunk is an error naming the fix. FLOPs: the kernels' matmuls,
the causal ones halved (torch's counter counts only the CUDA ones, whole).
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

import autoshard.rules.causal_chunks as causal_chunks
import autoshard.rules.ring_attention as ring_attention
import autoshard.rules.sdpa_kernels as sdpa_kernels
from autoshard import _torch_compat as tc
from autoshard.errors import InputError
from autoshard.ir import NodeSharding, output_vals, tensor_args
from autoshard.messages import warn
from autoshard.rules.base import OpRule

logger = logging.getLogger(__name__)

_Shape = Sequence[int]
_SEQ = 2  # [B, H, T, D]: the sequence dim of query, key, value and output; logsumexp [B, H, T] has it too
# shorter sequences are not offered the sequence split: the option multiplies every attention group's candidates
# (planning time), and a chunk of a few dozen queries against gathered keys and values is not what CP is for
_MIN_SEQ = 256


def _ops() -> frozenset[Any]:
    return sdpa_kernels.ops()


def _is_backward(node: fx.Node) -> bool:
    return sdpa_kernels.kernel_of(node.target)[1]


# per tensor role (``sdpa_kernels.roles``) on one axis: the sequence split with keys and values gathered
# ("seq"; the key and value gradients are each rank's queries' share), or everything on its sequence chunk ("ring")
_SEQ_ROLES = {
    "query": Shard(_SEQ),
    "key": Replicate(),
    "value": Replicate(),
    "grad": Shard(_SEQ),
    "out": Shard(_SEQ),
    "lse": Shard(_SEQ),
    "mask": Shard(_SEQ),
    "grad_query": Shard(_SEQ),
    "grad_key": Partial(),
    "grad_value": Partial(),
    "grad_mask": Shard(_SEQ),
}


def _layout(option: str, ins: Sequence[str], outs: Sequence[str]) -> tuple[list[Placement], list[Placement]]:
    """Per-tensor placements on one axis for ``option``, from the tensors' roles: inputs, then outputs. The
    kernels' small extras (rng state, offsets, a debug mask: role "aux") are whole on every rank."""
    if option == "seq":
        place = _SEQ_ROLES.get
    else:
        p = {"whole": Replicate(), "batch": Shard(0), "heads": Shard(1), "ring": Shard(_SEQ)}[option]
        place = lambda _role: p  # noqa: E731
    return (
        [Replicate() if r == "aux" else place(r) for r in ins],
        [Replicate() if r in ("aux", "max_q", "max_k") else place(r) for r in outs],
    )


def splits_sequence(node: fx.Node) -> bool:
    """Whether ``node`` (an attention op of this rule) is offered the sequence split (context parallelism)."""
    q, k = _val(node, "query"), _val(node, "key")
    return q.shape[_SEQ] == k.shape[_SEQ] and q.shape[_SEQ] >= _MIN_SEQ


def _val(node: fx.Node, role: str) -> torch.Tensor:
    return sdpa_kernels.roles(node).args[role].meta["val"]


def _dropout(node: fx.Node) -> float:
    p = sdpa_kernels.roles(node).args.get("dropout", 0.0)
    return p if isinstance(p, (int, float)) else 1.0  # (a traced value: assume dropout)


def candidates(node: fx.Node, ties: Sequence[int]) -> list[tc.RawStrategy]:
    """Per distinct mesh axis (``ties``: axes that must place alike share one choice): whole, batch, heads, or
    the sequence (self-attention of at least ``_MIN_SEQ`` tokens), with keys and values gathered ("seq") or
    passed around a ring ("ring", ``ring_attention``); the sequence on one axis at most. The ring takes no mask
    and no dropout (its blocks would need both sliced); on the CUDA kernels causal attention splits the
    sequence only without dropout (its balanced pieces have none, and flash has no mask to fall back on)."""
    kernel, _ = sdpa_kernels.kernel_of(node.target)
    roles = sdpa_kernels.roles(node)
    ins = [a.meta["val"] for a in tensor_args(node)]
    q = _val(node, "query")
    outs = output_vals(node)
    causal, dropout = _causal(node), _dropout(node)
    seq = splits_sequence(node) and not (causal and dropout and kernel.name != "cpu")
    options = (
        ["whole", "batch", "heads"]
        + (["seq"] if seq else [])
        + (["ring"] if seq and "mask" not in roles.tensors and not dropout else [])
    )
    free = sorted(set(ties))

    def fit(p: Placement, v: torch.Tensor, role: str) -> Placement:
        if not isinstance(p, Shard):
            return p
        # a mask broadcasts against the [B, H, T, S] scores from the right: a [T, S] mask's dim 0 is the queries'
        # sequence (dim 2), and it has no batch or head dim to split
        dim = p.dim - (q.ndim - v.ndim) if role == "mask" else p.dim
        return Replicate() if dim < 0 or v.ndim <= dim or v.shape[dim] == 1 < q.shape[p.dim] else Shard(dim)

    result = []
    for sub in itertools.product(options, repeat=len(free)):
        pick = dict(zip(free, sub))
        along = [pick[t] for t in ties if pick[t] in ("seq", "ring")]
        if len(along) > 1 and (causal or "ring" in along):
            continue  # the balanced causal kernel and the ring exchange chunks along one axis
        per_axis = [_layout(pick[t], roles.tensors, roles.outputs) for t in ties]
        in_pl = tuple(tuple(fit(ax[0][i], v, roles.tensors[i]) for ax in per_axis) for i, v in enumerate(ins))
        out_pl = tuple(tuple(ax[1][j] for ax in per_axis) if o is not None else None for j, o in enumerate(outs))
        result.append(tc.RawStrategy(in_pl, out_pl))
    return result


def runs_local(node: fx.Node, sharding: NodeSharding) -> bool:
    return True  # batch, heads and query chunks are independent: each rank's kernel on its shards


def _causal(node: fx.Node) -> bool:
    return bool(sdpa_kernels.roles(node).args.get("causal", False))


def _seq_axes(placements: Sequence[Placement] | None) -> list[int]:
    return [a for a, p in enumerate(placements or ()) if isinstance(p, Shard) and p.dim == _SEQ]


def _by_role(node: fx.Node, per_tensor: Sequence[Any]) -> dict[str, Any]:
    """role -> the entry of ``per_tensor`` (one per tensor argument of ``node``) of its first tensor of that role."""
    out: dict[str, Any] = {}
    for role, x in zip(sdpa_kernels.roles(node).tensors, per_tensor):
        out.setdefault(role, x)
    return out


def local_call(node: fx.Node, sharding: NodeSharding) -> Callable[[tuple, dict, DeviceMesh], Any] | None:
    """The call of ``node`` on this rank's shards where the traced call would be wrong on them: keys and values
    on their sequence chunks (the ring); causal attention whose queries are sequence-sharded (the load-balanced
    kernel, ``causal_chunks``, or where it cannot run, a mask given, dropout, an odd chunk, the CPU kernel with
    this rank's causal mask, with a warning); a CUDA kernel's sequence lengths on a sequence shard. Else None
    (the kernel as traced, on local shards)."""
    kernel, backward = sdpa_kernels.kernel_of(node.target)
    placed = _by_role(node, sharding.inputs)
    ring, axes = _seq_axes(placed.get("key")), _seq_axes(placed.get("query"))
    if ring:
        return _ring_call(node, ring[0])
    if not axes:
        return None
    if not _causal(node):
        return _sized_call(node) if "max_q" in sdpa_kernels.roles(node).args else None
    warned = []

    def call(args: tuple, kwargs: dict, mesh: DeviceMesh) -> Any:
        got, local, kw = _bound(node, args, kwargs)
        q_len = got["query"].shape[_SEQ]
        if (
            len(axes) == 1
            and got.get("mask") is None
            and not got.get("dropout")
            and causal_chunks.balanced(q_len, mesh.size(axes[0]))
        ):
            if backward:
                res = causal_chunks.backward(kernel, *(got[r] for r in _BACKWARD_IN), mesh, axes[0], kw)
            else:
                res = causal_chunks.forward(kernel, got["query"], got["key"], got["value"], mesh, axes[0], kw)
            return sdpa_kernels.results(node, res, q_len, got["key"].shape[_SEQ])
        why = (
            "a mask is given"
            if got.get("mask") is not None
            else "dropout"
            if got.get("dropout")
            else f"{q_len} local queries on mesh axes {axes} (one axis and an even chunk balance)"
        )
        if kernel.name != "cpu":
            raise InputError(
                f"{node.name} ({node.target}): causal attention on a sequence shard cannot be balanced "
                f"here ({why}); make the sequence a multiple of twice the mesh axis size, or "
                "constrain attention's inputs off the sequence"
            )
        if not warned:
            warned.append(True)
            warn(
                logger,
                "%s: causal attention on a sequence shard runs unbalanced (a full chunk of work on every "
                "rank, twice the planned): %s",
                node.name,
                why,
            )
        return _masked_cpu_call(node, args, local, kwargs, mesh, axes, backward)

    return call


_BACKWARD_IN = ("grad", "query", "key", "value", "out", "lse")


def _bound(node: fx.Node, args: tuple, kwargs: dict) -> tuple[dict[str, Any], list[Any], dict[str, Any]]:
    """(role -> local value, the local positional arguments, the kernel's keyword arguments for its pieces)."""
    local = [a.to_local() if hasattr(a, "to_local") else a for a in args]
    kw_local = {key: v.to_local() if hasattr(v, "to_local") else v for key, v in kwargs.items()}
    got = sdpa_kernels.bound(node.target, local, kw_local)
    if isinstance(got.get("lse"), torch.Tensor):  # the pieces take it as [B, H, Lq], whatever the kernel's layout
        got["lse"] = sdpa_kernels.plain_lse(
            sdpa_kernels.kernel_of(node.target)[0], got["lse"], got["query"].shape[_SEQ]
        )
    return got, local, ({"scale": got["scale"]} if got.get("scale") is not None else {})


def _sized_call(node: fx.Node) -> Callable[[tuple, dict, DeviceMesh], Any]:
    """A CUDA kernel as traced on its shards, told its local sequence lengths (traced whole)."""

    def call(args: tuple, kwargs: dict, mesh: DeviceMesh) -> Any:
        got, local, _ = _bound(node, args, kwargs)
        sizes = {"max_q": got["query"].shape[_SEQ], "max_k": got["key"].shape[_SEQ]}
        return node.target(
            *sdpa_kernels.with_args(node.target, local, sizes),
            **{k: v.to_local() if hasattr(v, "to_local") else v for k, v in kwargs.items()},
        )

    return call


def _masked_cpu_call(
    node: fx.Node, args: tuple, local: list[Any], kwargs: dict, mesh: DeviceMesh, axes: list[int], backward: bool
) -> Any:
    """The CPU kernel on this rank's query chunk against every key, with its causal mask made explicit."""
    given = kwargs.get("attn_mask")
    rest = {key: v for key, v in kwargs.items() if key not in ("attn_mask", "is_causal")}
    dropout = local[6 if backward else 3] if len(local) > (6 if backward else 3) else 0.0
    q, k = (args[1], args[2]) if backward else (args[0], args[1])
    t = k.shape[_SEQ]
    full = torch.arange(t, device=k.to_local().device)
    chunks = [Shard(0) if isinstance(p, Shard) and p.dim == _SEQ else Replicate() for p in q.placements]
    whole = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    pos = tc.redistribute(whole, mesh, chunks).to_local()  # this rank's query positions (no communication)
    mask = torch.zeros(pos.shape[0], t, dtype=q.dtype, device=full.device)
    mask = mask.masked_fill(full[None, :] > pos[:, None], float("-inf"))[None, None]
    if given is not None:
        mask = mask + (given.to_local() if hasattr(given, "to_local") else given)
    if backward:  # (grad_out, query, key, value, out, logsumexp, dropout_p, is_causal)
        return node.target(*local[:7], False, attn_mask=mask, **rest)
    return node.target(*local[:3], dropout, False, attn_mask=mask, **rest)


def _ring_call(node: fx.Node, axis: int) -> Callable[[tuple, dict, DeviceMesh], Any]:
    kernel, backward = sdpa_kernels.kernel_of(node.target)
    causal = _causal(node)

    def call(args: tuple, kwargs: dict, mesh: DeviceMesh) -> Any:
        got, _, kw = _bound(node, args, kwargs)
        q_len = got["query"].shape[_SEQ]
        if got.get("dropout") or (causal and not causal_chunks.balanced(q_len, mesh.size(axis))):
            raise InputError(
                f"{node.name} ({node.target}): ring attention over mesh axis {axis} (size "
                f"{mesh.size(axis)}) needs no dropout and, causal, an even chunk ({q_len} queries per "
                "rank); make the sequence a multiple of twice the axis size, or constrain attention's "
                "inputs off the sequence"
            )
        if backward:
            res = ring_attention.backward(kernel, *(got[r] for r in _BACKWARD_IN), mesh, axis, causal, kw)
        else:
            res = ring_attention.forward(kernel, got["query"], got["key"], got["value"], mesh, axis, causal, kw)
        return sdpa_kernels.results(node, res, q_len, got["key"].shape[_SEQ])

    return call


def exchanges(
    node: fx.Node, inputs: Sequence[Sequence[Placement] | None], mesh_shape: Sequence[int]
) -> list[tuple[str, int, int]]:
    """What the sequence-split kernels send per call at these input placements, priced next to the kernel:
    the load-balanced causal kernel's half-chunk swap with the mirror rank (``causal_chunks``), the ring's
    chunk passes (``ring_attention``): [(kind, mesh axis, bytes per device)]."""
    backward = _is_backward(node)
    roles = sdpa_kernels.roles(node)
    placed = _by_role(node, inputs)
    q_pl = placed["query"]
    axes = [a for a in _seq_axes(q_pl) if mesh_shape[a] > 1]
    ring = _seq_axes(placed["key"])
    if len(axes) != 1 or (not _causal(node) and not ring):
        return []
    shard = math.prod(n for p, n in zip(q_pl, mesh_shape) if isinstance(p, Shard))
    vals = _by_role(node, [a.meta["val"] for a in tensor_args(node)])
    if not backward:
        vals.update((role, v) for role, v in zip(roles.outputs, output_vals(node)) if role in ("out", "lse"))
    local = {
        name: vals[role].numel() * vals[role].element_size() // shard
        for name, role in (("query", "query"), ("key", "key"), ("value", "value"), ("out", "out"), ("logsumexp", "lse"))
    }
    if ring:
        return [
            (kind, axes[0], b)
            for kind, b in ring_attention.exchanged(backward, _causal(node), mesh_shape[axes[0]], local)
        ]
    return [("point_to_point", axes[0], causal_chunks.exchanged_bytes(backward, local))]


def _dims(query: _Shape, key: _Shape, value: _Shape) -> tuple[int, int, int, int, int]:
    """(B*Hq, Lq, Lk, Dq, Dv) from [B, H, L, D] shapes; key/value may have fewer heads (GQA), the kernel
    broadcasts them, so the work follows the query's heads."""
    *batch, lq, dq = query
    lk, dv = key[-2], value[-1]
    return math.prod(batch), lq, lk, dq, dv


def _flop_formula(op: Any) -> Callable[..., int]:
    """FLOPs of one call of ``op`` (any kernel's forward or backward), from its arguments as shapes.

    Forward: two matmuls, scores = q @ k^T (2*Lq*Lk*Dq per head) and out = p @ v (2*Lq*Lk*Dv). Backward: five,
    as torch counts the CUDA flash backward (recompute q @ k^T, dP = dO @ v^T, dV = P^T @ dO, dQ = dS @ k,
    dK = dS^T @ q): 2*Lq*Lk*(3*Dq + 2*Dv) per head, 2.5x the forward when Dq == Dv. The causal kernel skips the
    masked upper triangle (torch's counter counts it whole). The planner counts on global shapes and divides by
    the shards; a sequence shard of the queries, fewer queries than keys, is then the balanced causal share."""
    _, backward = sdpa_kernels.kernel_of(op)

    def flops(*args: Any, **kwargs: Any) -> int:
        got = sdpa_kernels.bound(op, args, {k: v for k, v in kwargs.items() if k != "out_val"})
        bh, lq, lk, dq, dv = _dims(got["query"], got["key"], got["value"])
        total = 2 * bh * lq * lk * ((3 * dq + 2 * dv) if backward else (dq + dv))
        return total // 2 if got.get("causal") and lq == lk else total

    return flops


def _flops() -> Mapping[Any, Callable[..., int]]:
    return {
        name: _flop_formula(sdpa_kernels.kernel_of(name)[0].op(sdpa_kernels.kernel_of(name)[1]))
        for name in sdpa_kernels.ops()
    }


RULE = OpRule(
    "attention",
    _ops,
    candidates=candidates,
    runs_local=runs_local,
    flops=_flops,
    local_call=local_call,
    exchanges=exchanges,
)
