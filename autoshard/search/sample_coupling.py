"""Whether a training program mixes the samples of its batch before the loss: then gradient accumulation changes it.

Gradient accumulation (``autoshard/search/accumulate.py``) runs the batch as k micro-batches and adds their weighted
gradients up. That equals the whole batch only when every sample's loss term depends on that sample alone: a model
that normalizes by a statistic over the batch (``x / x.sum(0)``, training-mode BatchNorm, a mixture of experts'
load-balancing loss over the batch's routing) sees only its micro-batch's samples in each. The planner may choose
accumulation by itself (to fit a memory budget): it must not change what the model computes.

``mixes_samples(planned, batched)`` follows the batch dimension through the captured forward graph as DTensor's
own rules would shard it (a Shard of dim 0 of every batched input on one mesh axis, ``CandidateEnumerator.follow``)
and returns the first forward op that gathers the batch, reduces over it into anything but the scalar loss, or
combines such a reduction with per-sample values; None when the samples stay apart up to the loss. An op DTensor
cannot follow is counted as mixing (the answer must never be a wrong "no").
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from autoshard.compiler.candidates import CandidateEnumerator
from autoshard.ir import output_vals, tensor_args
from autoshard.search.planned import Planned

log = logging.getLogger(__name__)

__all__ = ["mixes_samples"]


def mixes_samples(planned: Planned, batched: Sequence[bool]) -> str | None:
    """The first forward op of ``planned``'s graph that mixes the samples of the batch (its name, target and the
    module it runs in), or None. ``batched``: which user inputs carry the batch on dim 0 (``batched_inputs``)."""
    gm, ctx = planned.graph, planned.ctx
    cached = ctx.cache.enumerator if ctx.cache is not None else None  # (what planning asked DTensor already)
    en = cached if cached is not None else CandidateEnumerator(ctx)
    axes = len(ctx.mesh_shape)
    batch_dim: dict[str, tuple[int | None, ...]] = {}  # node -> per output: the dim holding the batch (None: none)
    reduced: set[str] = set()  # values summed over the batch (a scalar on its way to the loss)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            role = node.meta.get("autoshard_role")
            if role is not None and role.kind == "input" and role.index < len(batched) and batched[role.index]:
                batch_dim[node.name] = (0,)
            continue
        if node.op != "call_function" or node.meta.get("autoshard_phase", "forward") != "forward":
            continue
        if node.target is operator.getitem:
            src = node.args[0]
            dims = batch_dim.get(src.name) if isinstance(src, fx.Node) else None
            if dims is not None and dims[node.args[1]] is not None:
                batch_dim[node.name] = (dims[node.args[1]],)
            if isinstance(src, fx.Node) and src.name in reduced:
                reduced.add(node.name)
            continue
        args = tensor_args(node)
        carried = [(k, batch_dim[a.name][0]) for k, a in enumerate(args) if batch_dim.get(a.name, (None,))[0] is not None]
        from_sum = any(a.name in reduced for a in args)
        outs = output_vals(node)
        scalar = all(v is None or v.ndim == 0 for v in outs)
        if from_sum and (carried or not scalar):
            return _where(node, "combines a sum over the batch with per-sample values")
        if from_sum:
            reduced.add(node.name)
            continue
        if not carried:
            continue
        k, dim = carried[0]
        have = (Shard(dim),) + (Replicate(),) * (axes - 1)
        raw = en.follow(node, k, have)
        if raw is None:
            return _where(node, "has no DTensor rule to follow the batch through")
        if tuple(raw.inputs[k]) != have:
            return _where(node, "needs the whole batch at once")
        dims: list[int | None] = []
        for pl, v in zip(raw.outputs, outs):
            first = None if pl is None else pl[0]
            if isinstance(first, Shard):
                dims.append(first.dim)
            elif first is not None and first.is_partial() and v is not None and v.ndim == 0:
                reduced.add(node.name)  # the loss (a mean or sum over the batch)
                dims.append(None)
            elif first is not None and first.is_partial():
                return _where(node, "sums over the batch into a non-scalar")
            elif v is not None and isinstance(v, torch.Tensor) and v.ndim and first is not None:
                return _where(node, "makes a value every sample reads")
            else:
                dims.append(None)
        batch_dim[node.name] = tuple(dims)
    return None


def _where(node: fx.Node, what: str) -> str:
    module = node.meta.get("autoshard_module", "")
    shapes = ", ".join(str(list(a.meta["val"].shape)) for a in tensor_args(node))
    return f"{node.target} ({node.name}{f' in {module}' if module else ''}, inputs {shapes}) {what}"
