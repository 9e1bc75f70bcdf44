"""Scaled dot-product attention on CPU (``_scaled_dot_product_flash_attention_for_cpu`` and its backward).

DTensor has no strategy for the CPU kernel. Ours: every tensor sharded on the batch, or on the heads, per mesh
axis (attention is independent across both); an input that broadcasts on that dimension (an attention mask
``[B, 1, T, T]`` has one head) stays whole on it. DTensor cannot run it either, so the lowering calls the
kernel on each rank's local shards. FLOPs: the kernel's matmuls (torch's counter knows only the CUDA ones).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autoshard import _torch_compat as tc
from autoshard.ir import NodeSharding, output_vals, tensor_args
from autoshard.rules.base import OpRule

_Shape = Sequence[int]


def _ops() -> frozenset[Any]:
    aten = torch.ops.aten
    return frozenset({aten._scaled_dot_product_flash_attention_for_cpu.default,
                      aten._scaled_dot_product_flash_attention_for_cpu_backward.default})


def candidates(node: fx.Node, ties: Sequence[int]) -> list[tc.RawStrategy]:
    """Per distinct mesh axis (``ties``: axes that must place alike share one choice): whole, batch or heads."""
    ins = [a.meta["val"] for a in tensor_args(node)]
    backward = node.target is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    q = ins[1] if backward else ins[0]
    outs = output_vals(node)
    per_axis: list[Placement] = [Replicate(), Shard(0), Shard(1)]
    free = sorted(set(ties))

    def fit(pl: tuple, v: torch.Tensor) -> tuple:
        return tuple(Replicate() if isinstance(p, Shard) and v.shape[p.dim] == 1 < q.shape[p.dim] else p for p in pl)

    result = []
    for sub in itertools.product(per_axis, repeat=len(free)):
        pick = dict(zip(free, sub))
        pl = tuple(pick[t] for t in ties)
        result.append(tc.RawStrategy(tuple(fit(pl, v) for v in ins), tuple(pl if o is not None else None for o in outs)))
    return result


def runs_local(node: fx.Node, sharding: NodeSharding) -> bool:
    return True  # batch and heads are independent: each rank's kernel on its shards is the sharded attention


def _dims(query: _Shape, key: _Shape, value: _Shape) -> tuple[int, int, int, int, int]:
    """(B*Hq, Lq, Lk, Dq, Dv) from [B, H, L, D] shapes; key/value may have fewer heads (GQA), the kernel
    broadcasts them, so the work follows the query's heads."""
    *batch, lq, dq = query
    lk, dv = key[-2], value[-1]
    return math.prod(batch), lq, lk, dq, dv


def _forward_flops(query: _Shape, key: _Shape, value: _Shape, *rest: Any, is_causal: bool = False, **_: Any) -> int:
    # Two matmuls: scores = q @ k^T (2*Lq*Lk*Dq per head) and out = p @ v (2*Lq*Lk*Dv); = 4*B*H*Lq*Lk*D when
    # Dq == Dv. Positional signature: (query, key, value, dropout_p=0., is_causal=False).
    if len(rest) >= 2:
        is_causal = bool(rest[1])
    bh, lq, lk, dq, dv = _dims(query, key, value)
    flops = 2 * bh * lq * lk * (dq + dv)
    return flops // 2 if is_causal else flops  # the causal kernel skips the masked upper triangle


def _backward_flops(grad_out: _Shape, query: _Shape, key: _Shape, value: _Shape, *rest: Any,
                    is_causal: bool = False, **_: Any) -> int:
    # Five matmuls, as torch counts the CUDA flash backward: recompute q @ k^T, dP = dO @ v^T, dV = P^T @ dO,
    # dQ = dS @ k, dK = dS^T @ q -> 2*Lq*Lk*(3*Dq + 2*Dv) per head = 2.5x the forward when Dq == Dv.
    # Positional signature: (grad_out, query, key, value, out, logsumexp, dropout_p, is_causal).
    if len(rest) >= 4:
        is_causal = bool(rest[3])
    bh, lq, lk, dq, dv = _dims(query, key, value)
    flops = 2 * bh * lq * lk * (3 * dq + 2 * dv)
    return flops // 2 if is_causal else flops


def _flops() -> Mapping[Any, Callable[..., int]]:
    aten = torch.ops.aten
    return {aten._scaled_dot_product_flash_attention_for_cpu.default: _forward_flops,
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _backward_flops}


RULE = OpRule("cpu attention", _ops, candidates=candidates, runs_local=runs_local, flops=_flops)
