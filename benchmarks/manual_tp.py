"""Hand-written Megatron tensor parallelism for the benchmarks' models, as a user would write it with
``torch.distributed.tensor.parallel.parallelize_module``: the twin ``autoshard``'s ``tp`` recipe is measured against.

- The zoo GPT (``nn.Linear`` projections): ColwiseParallel on q, k, v and fc1, RowwiseParallel on the attention
  output and fc2, the attention running on this rank's heads.
- A stock ``transformers`` GPT-2 (``GPT2LMHeadModel``): its projections are ``Conv1D`` (``x @ W + b`` with ``W``
  stored [in, out]) and q, k, v are one fused ``c_attn``, which ``parallelize_module``'s styles do not take. Each
  ``Conv1D`` is replaced by the ``nn.Linear`` it equals (``W`` transposed); the fused ``c_attn``'s output rows are
  reordered rank-major, [q, k, v of rank 0's heads, then rank 1's, ...], so that its column-parallel shard on rank
  r is exactly r's heads' q, k and v, and the attention's ``split_size`` becomes the local width. The model's own
  forward then runs unchanged on its local heads; the loss equals the unsharded model's.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["apply_tp"]


def _local_heads_forward(self: nn.Module, x: Tensor) -> Tensor:
    """CausalSelfAttention.forward on column-parallel q/k/v: this rank's heads (``-1`` where the global count was)."""
    b, t, _ = x.shape
    q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
    k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
    v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.wo(y.transpose(1, 2).contiguous().view(b, t, -1))


def _gpt_plan(model: nn.Module) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for i, block in enumerate(model.layers):
        for name in ("attn.wq", "attn.wk", "attn.wv", "mlp.fc1"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.wo", "mlp.fc2"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
        block.attn.forward = types.MethodType(_local_heads_forward, block.attn)
    return plan


def _as_linear(conv: nn.Module, rows: Tensor | None = None) -> nn.Linear:
    """The ``nn.Linear`` equal to a transformers ``Conv1D`` (weight [in, out]), output rows optionally reordered."""
    weight = conv.weight.detach().t()
    bias = conv.bias.detach()
    if rows is not None:
        weight, bias = weight[rows], bias[rows]
    lin = nn.Linear(weight.shape[1], weight.shape[0], device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
        lin.bias.copy_(bias)
    return lin


def _rank_major_qkv(d: int, tp: int) -> Tensor:
    """Row order of the fused [q; k; v] projection (3d rows) that puts each rank's q, k and v rows together."""
    part = d // tp
    return torch.cat([torch.arange(s * d + r * part, s * d + (r + 1) * part) for r in range(tp) for s in range(3)])


def _gpt2_plan(model: nn.Module, tp: int) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for i, block in enumerate(model.transformer.h):
        attn, mlp = block.attn, block.mlp
        d = attn.embed_dim
        if attn.num_heads % tp:
            raise ValueError(f"GPT-2 TP: {attn.num_heads} heads do not split over {tp} ranks")
        attn.c_attn = _as_linear(attn.c_attn, _rank_major_qkv(d, tp))
        attn.c_proj = _as_linear(attn.c_proj)
        attn.split_size = d // tp  # the local q, k, v widths the forward splits c_attn's local output into
        mlp.c_fc, mlp.c_proj = _as_linear(mlp.c_fc), _as_linear(mlp.c_proj)
        prefix = f"transformer.h.{i}"
        plan.update(
            {
                f"{prefix}.attn.c_attn": ColwiseParallel(),
                f"{prefix}.attn.c_proj": RowwiseParallel(),
                f"{prefix}.mlp.c_fc": ColwiseParallel(),
                f"{prefix}.mlp.c_proj": RowwiseParallel(),
            }
        )
    return plan


def apply_tp(model: nn.Module, tp_mesh: Any, kind: str) -> None:
    """Megatron TP of ``model`` ("gpt": the zoo GPT, "hf": a transformers GPT-2) over ``tp_mesh`` (1-D)."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan = _gpt_plan(model) if kind == "gpt" else _gpt2_plan(model, tp_mesh.size())
    parallelize_module(model, tp_mesh, plan)
