"""Vocabulary-parallel cross-entropy: the loss on logits whose class dim is sharded (Megatron's parallel loss).

A column-parallel output layer leaves each rank of a mesh axis with a slice of the vocabulary's logits
``[N, V/n]``. DTensor can only gather them for ``_log_softmax`` and ``nll_loss`` (``N x V`` per device: the
largest activation of a large-vocabulary model). This rule adds, to DTensor's candidates for the four ops of a
cross-entropy, the same layouts with the class dim ``Shard(1)`` on one more axis, computed on the slices:

- ``_log_softmax``: the row max and the row sum of exponentials all-reduced over the axis (two ``[N]``
  all-reduces), then ``x - max - log(sum)`` on the slice;
- ``nll_loss_forward`` (``sum`` or ``none``; capture rewrites a mean as sum / count): each rank picks the
  targets that fall in its slice, the loss ``Partial`` over the axis; the count of targets is whole;
- ``nll_loss_backward``: ``-grad`` (over the count, for a mean) at the rank's own targets, the gradient
  class-sharded;
- ``_log_softmax_backward_data``: ``g - exp(out) * sum(g)``, the row sum all-reduced (one ``[N]``).

The all-reduces are priced with the op (``exchanges``). Other axes keep DTensor's layout (rows split over the
batch), which the local computation matches: rows are independent and sums over them stay Partial.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autoshard import _torch_compat as tc
from autoshard.ir import NodeSharding, tensor_args
from autoshard.rules.base import OpRule

_CLASS = 1  # [N, V]


def _ops() -> frozenset[Any]:
    aten = torch.ops.aten
    return frozenset(
        {
            aten._log_softmax.default,
            aten._log_softmax_backward_data.default,
            aten.nll_loss_forward.default,
            aten.nll_loss_backward.default,
        }
    )


def _shape(node: fx.Node) -> tuple[str, list[int], list[int], dict[int, Placement]] | None:
    """(kind, class-sharded tensor args, class-sharded outputs, outputs made Partial) of ``node``, or None where
    the vocabulary split does not apply (not 2-D, another dim, a class weight, a mean reduction)."""
    aten = torch.ops.aten
    t, args = node.target, node.args
    vals = [a.meta["val"] for a in tensor_args(node)]
    if (
        not vals
        or vals[
            0
            if t in (aten._log_softmax.default, aten._log_softmax_backward_data.default, aten.nll_loss_forward.default)
            else 1
        ].ndim
        != 2
    ):
        return None
    if t is aten._log_softmax.default:
        return ("log_softmax", [0], [0], {}) if args[1] in (1, -1) else None
    if t is aten._log_softmax_backward_data.default:
        return ("log_softmax_backward", [0, 1], [0], {}) if args[2] in (1, -1) else None
    if t is aten.nll_loss_forward.default:
        return ("nll", [0], [], {0: Partial()}) if args[2] is None and args[3] in (0, 2) else None
    if t is aten.nll_loss_backward.default:
        return ("nll_backward", [1], [0], {}) if args[3] is None and args[4] in (0, 1, 2) else None
    return None


def more_candidates(node: fx.Node, found: Sequence[tc.RawStrategy], mesh_shape: Sequence[int]) -> list[tc.RawStrategy]:
    """DTensor's candidates ``found`` with the class dim moved onto one more mesh axis, where it is whole."""
    spec = _shape(node)
    if spec is None:
        return []
    _, sharded_in, sharded_out, partial_out = spec
    out = []
    for c in found:
        for axis, n in enumerate(mesh_shape):
            if n == 1 or any(
                isinstance(pl[axis], Shard) and pl[axis].dim == _CLASS
                for pl in (*c.inputs, *(o for o in c.outputs if o is not None))
            ):
                continue
            every = [*(c.inputs[i] for i in range(len(c.inputs))), *(o for o in c.outputs if o is not None)]
            if any(not isinstance(pl[axis], Replicate) for pl in every):
                continue  # only a layout whole on this axis gains the class split there

            def put(pl: tuple, p: Placement, axis: int = axis) -> tuple:
                return tuple(p if a == axis else q for a, q in enumerate(pl))

            ins = tuple(put(pl, Shard(_CLASS)) if i in sharded_in else pl for i, pl in enumerate(c.inputs))
            outs = tuple(
                None
                if o is None
                else put(o, Shard(_CLASS))
                if j in sharded_out
                else put(o, partial_out[j])
                if j in partial_out
                else o
                for j, o in enumerate(c.outputs)
            )
            out.append(tc.RawStrategy(ins, outs))
    return out


def _vocab_axis(node: fx.Node, sharding: NodeSharding) -> int | None:
    spec = _shape(node)
    if spec is None:
        return None
    pl = sharding.inputs[spec[1][0]]
    axes = [a for a, p in enumerate(pl or ()) if isinstance(p, Shard) and p.dim == _CLASS]
    return axes[0] if len(axes) == 1 else None


def runs_local(node: fx.Node, sharding: NodeSharding) -> bool:
    return _vocab_axis(node, sharding) is not None  # DTensor has no rule for a class-sharded loss


def _offset(v: int, mesh: DeviceMesh, placements: Sequence[Placement]) -> torch.Tensor:
    """The first vocabulary index of this rank's slice, as a one-element tensor (per rank under simulation)."""
    chunks = [Shard(0) if isinstance(p, Shard) and p.dim == _CLASS else Replicate() for p in placements]
    whole = DTensor.from_local(torch.arange(v), mesh, [Replicate()] * mesh.ndim, run_check=False)
    return tc.redistribute(whole, mesh, chunks).to_local()[:1]


def local_call(node: fx.Node, sharding: NodeSharding) -> Callable[[tuple, dict, DeviceMesh], Any] | None:
    """The class-sharded computation (module docstring) on this rank's slice; None when not class-sharded."""
    axis = _vocab_axis(node, sharding)
    spec = _shape(node)
    if axis is None or spec is None:
        return None
    kind, logits = spec[0], spec[1][0]
    class_pl = sharding.inputs[logits]
    full_v = tensor_args(node)[logits].meta["val"].shape[_CLASS]

    def call(args: tuple, kwargs: dict, mesh: DeviceMesh) -> Any:
        a = [x.to_local() if isinstance(x, DTensor) else x for x in args]
        if kind == "log_softmax":
            x = a[0].float() if a[2] else a[0]
            top = tc.all_reduce_on(x.amax(_CLASS, keepdim=True), "max", mesh, axis)
            total = tc.all_reduce_on((x - top).exp().sum(_CLASS, keepdim=True), "sum", mesh, axis)
            return x - top - total.log()
        if kind == "log_softmax_backward":
            g, out, dtype = a[0], a[1], a[3]
            total = tc.all_reduce_on(g.sum(_CLASS, keepdim=True), "sum", mesh, axis)
            return (g - out.exp() * total).to(dtype)
        lo = _offset(full_v, mesh, class_pl)
        if kind == "nll":
            x, target, reduction, ignore = a[0], a[1], a[3], a[4]
            mine, index = _mine(x, target, ignore, lo)
            picked = -(x.gather(_CLASS, index[:, None]).squeeze(_CLASS) * mine)
            count = (target != ignore).sum().to(x.dtype)
            return (picked.sum() if reduction == 2 else picked), count
        g, x, target, reduction, ignore, count = a[0], a[1], a[2], a[4], a[5], a[6]
        mine, index = _mine(x, target, ignore, lo)
        value = (-g).expand(target.shape) if g.ndim == 0 else -g
        if reduction == 1:  # mean (autograd's backward of the mean that capture rewrote as sum / count)
            value = value / count
        return torch.zeros_like(x).scatter(_CLASS, index[:, None], (value * mine)[:, None].to(x.dtype))

    return call


def _mine(x: torch.Tensor, target: torch.Tensor, ignore: int, lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(which rows' targets fall in this rank's slice, as 0/1 of x's dtype; their index in the slice)."""
    v = x.shape[_CLASS]
    index = target - lo
    mine = (index >= 0) & (index < v) & (target != ignore)
    return mine.to(x.dtype), index.clamp(0, v - 1)


def exchanges(
    node: fx.Node, inputs: Sequence[Sequence[Placement] | None], mesh_shape: Sequence[int]
) -> list[tuple[str, int, int]]:
    """The row all-reduces over the vocabulary axis at these input placements: [(kind, axis, bytes)]."""
    spec = _shape(node)
    if spec is None or spec[0].startswith("nll"):
        return []
    pl = inputs[spec[1][0]]
    axes = [a for a, p in enumerate(pl or ()) if isinstance(p, Shard) and p.dim == _CLASS]
    if len(axes) != 1:
        return []
    rows = tensor_args(node)[0].meta["val"].shape[0]
    rows //= math.prod(n for p, n in zip(pl, mesh_shape) if isinstance(p, Shard) and p.dim == 0)
    calls = 2 if spec[0] == "log_softmax" else 1
    return [("all_reduce", axes[0], rows * 4)] * calls


RULE = OpRule(
    "vocabulary-parallel cross-entropy",
    _ops,
    more_candidates=more_candidates,
    runs_local=runs_local,
    local_call=local_call,
    exchanges=exchanges,
)

__all__ = ["RULE", "more_candidates"]
