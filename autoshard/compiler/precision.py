"""How the model runs under ``PlanConfig.mixed_precision``, traced into the joint graph so the program needs no
context when it runs (docs/guide/mixed-precision.md).

Two policies (``PlanConfig.precision_policy``):

- ``"params"`` (the default), FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=...)`` as torchtitan
  and Megatron-LM run it: every floating parameter is cast to bf16 and the model runs on the casts, so the whole
  forward and backward (the residual stream, norms' outputs, saved activations) is bf16; floating inputs are cast
  too (FSDP2's ``cast_forward_inputs``). Each cast is an op of the graph on the fp32 master (the solver places it,
  so a sharded weight is cast on its shard and gathered in bf16) and its gradient is the bf16 gradient cast back
  to fp32, which the masters, the reductions (in ``reduce_dtype``) and the optimizer state keep.
- ``"autocast"``: ``torch.autocast``: matmuls and convolutions on bf16 copies of the fp32 parameters, every other
  op in fp32 (the Hugging Face Trainer's, Accelerate's and Lightning's ``bf16``).

``place_parameter_casts`` then moves each parameter cast of the ``"params"`` policy next to the op that first reads
it, in that op's module, so a layer's casts stay in the layer (identical layers stay identical, pipeline stages
cut them with their layer) and a cast lives from its first use, as under autocast.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from autoshard import _torch_compat as tc

_CASTS = {torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default}


def run_model(
    inner: nn.Module,
    args: tuple,
    kwargs: Mapping[str, Any],
    mixed_precision: str | None,
    policy: str,
    device: torch.device,
    cast_inputs: bool = True,
) -> Any:
    """``inner(*args, **kwargs)`` under the precision policy (module docstring). ``cast_inputs=False``: a
    pipeline stage, whose inputs are the previous stage's values in the dtypes the model made them (the stages'
    split was traced under the policy, ``autoshard/pipeline/wiring.py: split_model``, and cast the model's own
    inputs in the first stage)."""
    if mixed_precision is None:
        return inner(*args, **kwargs)
    dtype = getattr(torch, mixed_precision)
    if policy == "autocast":
        with torch.autocast(device_type=device.type, dtype=dtype):
            return inner(*args, **kwargs)
    cast = {name: p.to(dtype) if p.is_floating_point() else p for name, p in inner.named_parameters()}
    if cast_inputs:
        leaves, spec = tc.tree_flatten((tuple(args), dict(kwargs)))
        leaves = [t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in leaves]
        args, kwargs = tc.tree_unflatten(leaves, spec)
    return torch.func.functional_call(inner, cast, args, kwargs, strict=False)


def place_parameter_casts(gm: fx.GraphModule) -> bool:
    """Move each forward cast of a parameter to just before its first reader and give it that reader's module
    (traced before the model ran, they stand at the graph's start in no module). True if the graph changed."""
    changed = False
    order = {n: i for i, n in enumerate(gm.graph.nodes)}  # moving casts keeps the other nodes' order
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _CASTS or not node.users:
            continue
        src = node.args[0]
        if not isinstance(src, fx.Node) or src.op != "placeholder":
            continue
        role = src.meta.get("autoshard_role")
        if role is None or role.kind != "parameter" or node.meta.get("autoshard_phase") != "forward":
            continue
        first = min(node.users, key=order.__getitem__)
        node.meta["autoshard_module"] = first.meta.get("autoshard_module", "")
        if node.next is not first:
            first.prepend(node)
            changed = True
    return changed
