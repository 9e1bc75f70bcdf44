"""Grouped expert matmuls of stock ``transformers`` mixtures of experts (``transformers::grouped_mm_fallback``).

``transformers`` runs a MoE layer's experts as one grouped matmul over the routed tokens sorted by expert:
``input [S, in]`` (S = tokens x top-k), ``weight [E, in, out]``, ``offs [E]`` the cumulative row count of each
expert; on CPU (and for non-bf16 weights) as the custom op ``grouped_mm_fallback``, opaque to DTensor. Per mesh
axis this rule offers:

- whole: every tensor replicated;
- experts (expert parallelism, Megatron's all-gather dispatcher): the weight ``Shard(0)``, one slice of experts
  per rank, the sorted rows and offsets whole; each rank runs the rows of its own experts and leaves the others
  zero, so the output (and the input gradient) is ``Partial`` over the axis, summed by a reduce-scatter back to
  the tokens; the weight gradient stays on its rank;
- in / out (tensor parallelism inside every expert): the contraction dim split (``input`` ``Shard(1)``, weight
  ``Shard(1)``, output ``Partial``) or the output dim (weight ``Shard(2)``, output ``Shard(1)``).

The experts layout runs the same op on the rank's experts: the rows are rotated so that the first local
expert's rows start at 0 and the offsets shifted to match (rows past the last local expert are the op's zeros),
then rotated back: tensor ops only, so a traced per-rank program keeps no data-dependent shape.
FLOPs: ``2 * S * in * out`` (every routed row through one expert).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autoshard import _torch_compat as tc
from autoshard.ir import NodeSharding, tensor_args
from autoshard.rules.base import OpRule

FORWARD = "transformers.grouped_mm_fallback.default"
BACKWARD = "transformers.grouped_mm_fallback_backward.default"


def _ops() -> frozenset[Any]:
    return frozenset({FORWARD, BACKWARD})  # by name: the namespace exists only once transformers registered it


def _layout(option: str, backward: bool) -> tuple[list[Placement], list[Placement]]:
    """Placements on one axis: (input, weight, offs[, grad_output]) and the outputs."""
    r, p = Replicate(), Partial()
    if option == "whole":
        return ([r] * 4, [r, r]) if backward else ([r] * 3, [r])
    if option == "experts":
        return ([r, Shard(0), r, r], [p, Shard(0)]) if backward else ([r, Shard(0), r], [p])
    if option == "in":
        return ([Shard(1), Shard(1), r, r], [Shard(1), Shard(1)]) if backward else ([Shard(1), Shard(1), r], [p])
    return ([r, Shard(2), r, Shard(1)], [p, Shard(2)]) if backward else ([r, Shard(2), r], [Shard(1)])  # out


def candidates(node: fx.Node, ties: Sequence[int]) -> list[tc.RawStrategy]:
    """Per distinct mesh axis (``ties``): whole, experts, in or out (the module docstring); experts on one
    axis at most (the rotation takes one rank index)."""
    backward = str(node.target) == BACKWARD
    n_out = 2 if backward else 1
    free = sorted(set(ties))
    result = []
    for sub in itertools.product(("whole", "experts", "in", "out"), repeat=len(free)):
        pick = dict(zip(free, sub))
        if sum(pick[t] == "experts" for t in ties) > 1:
            continue
        per_axis = [_layout(pick[t], backward) for t in ties]
        ins = tuple(tuple(ax[0][i] for ax in per_axis) for i in range(len(tensor_args(node))))
        outs = tuple(tuple(ax[1][j] for ax in per_axis) for j in range(n_out))
        result.append(tc.RawStrategy(ins, outs))
    return result


def runs_local(node: fx.Node, sharding: NodeSharding) -> bool:
    return True  # a custom op DTensor cannot dispatch: each rank's op on its shards


def _experts_axis(sharding: NodeSharding) -> int | None:
    axes = [a for a, p in enumerate(sharding.inputs[1] or ()) if isinstance(p, Shard) and p.dim == 0]
    return axes[0] if axes else None


def _rotation(offs: torch.Tensor, first: int, count: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row order that starts at expert ``first``'s rows, the order back, the local experts' offsets)."""
    bounds = torch.cat([offs.new_zeros(1), offs])
    start = bounds[first : first + 1].long()
    order = (torch.arange(rows, device=offs.device) + start) % rows
    back = (torch.arange(rows, device=offs.device) - start) % rows
    return order, back, (offs[first : first + count] - bounds[first : first + 1]).to(offs.dtype)


def _forward_local(op: Any, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, r: int) -> torch.Tensor:
    order, back, local = _rotation(offs, r * w.shape[0], w.shape[0], x.shape[0])
    return op(x[order], w, local)[back]


def _backward_local(
    op: Any, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, g: torch.Tensor, r: int
) -> tuple[torch.Tensor, torch.Tensor]:
    order, back, local = _rotation(offs, r * w.shape[0], w.shape[0], x.shape[0])
    dx, dw = op(x[order], w, local, g[order])
    return dx[back], dw


def local_call(node: fx.Node, sharding: NodeSharding) -> Callable[[tuple, dict, DeviceMesh], Any] | None:
    """The experts layout: the op on this rank's experts (module docstring); else None (the op on shards)."""
    axis = _experts_axis(sharding)
    if axis is None:
        return None
    backward = str(node.target) == BACKWARD

    def call(args: tuple, kwargs: dict, mesh: DeviceMesh) -> Any:
        a = [x.to_local() if isinstance(x, DTensor) else x for x in (*args, *kwargs.values())]
        r = mesh.get_local_rank(axis)
        if backward:
            return tc.for_each_rank(_backward_local)(node.target, *a[:4], r)
        return tc.for_each_rank(_forward_local)(node.target, *a[:3], r)

    return call


def _forward_flops(x: Sequence[int], w: Sequence[int], *_: Any, **__: Any) -> int:
    return 2 * x[0] * w[1] * w[2]


def _backward_flops(x: Sequence[int], w: Sequence[int], *_: Any, **__: Any) -> int:
    return 4 * x[0] * w[1] * w[2]  # the input gradient and the weight gradient


def _flops() -> Mapping[Any, Callable[..., int]]:
    return {FORWARD: _forward_flops, BACKWARD: _backward_flops}


RULE = OpRule(
    "transformers grouped expert matmul",
    _ops,
    candidates=candidates,
    runs_local=runs_local,
    flops=_flops,
    local_call=local_call,
)

__all__ = ["RULE"]
