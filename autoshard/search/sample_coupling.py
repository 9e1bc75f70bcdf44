"""Whether a training program mixes the samples of its batch before the loss: then gradient accumulation changes it.

Gradient accumulation (``autoshard/search/accumulate.py``) runs the batch as k micro-batches and adds their weighted
gradients up. That equals the whole batch only when every sample's loss term depends on that sample alone: a model
that normalizes by a statistic over the batch (``x / x.sum(0)``, training-mode BatchNorm, a mixture of experts'
load-balancing loss over the batch's routing) sees only its micro-batch's samples in each. The planner may choose
accumulation by itself (to fit a memory budget): it must not change what the model computes.

``coupling(planned, batched)`` follows the batch dimension through the captured forward graph as the planner's
own rules would shard it (a Shard of dim 0 of every batched input on one mesh axis): an op with a rule of ours
(``autoshard/rules``: attention kernels, grouped expert matmuls, random draws) by that rule's candidates, any
other op by DTensor's (``CandidateEnumerator.follow``), and an index by ``arange`` over the batch (transformers'
padding masks, ``sample_coupling_index``) as selecting each sample's own row. It reports the first forward op
that provably mixes samples: one that reduces over the batch into anything but the scalar loss, combines such a
reduction with per-sample values, makes a value every sample reads, or needs the whole batch for a computation
(a matmul against another batched value, a scan, a reduction). Ops the check cannot follow the batch through
(no rule, or a rule that only gathers the batch for an op that moves values rather than combining them: a
sort, an index, a scatter, as a mixture of experts dispatches its tokens) are reported as *unknown*: their
outputs are not followed further, the rest of the graph still is, and accumulation stays allowed (with a
warning naming them, ``accumulate.py``).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from autoshard import rules as op_rules
from autoshard.compiler.candidates import CandidateEnumerator
from autoshard.ir import output_vals, tensor_args
from autoshard.search.planned import Planned
from autoshard.search.sample_coupling_index import IotaTracker

log = logging.getLogger(__name__)

__all__ = ["Coupling", "coupling", "mixes_samples"]

aten = torch.ops.aten
# ops that move values between positions without combining them: gathering the batch for one may still keep every
# sample's values apart (a mixture of experts sorts its tokens by expert and scatters the results back); the
# check cannot tell, so they are unknown rather than mixing
_MOVERS = {
    "aten.sort.default",
    "aten.sort.stable",
    "aten.argsort.default",
    "aten.argsort.stable",
    "aten.index.Tensor",
    "aten.index_select.default",
    "aten.gather.default",
    "aten.scatter.src",
    "aten.scatter.value",
    "aten.index_put.default",
    "aten.index_put_.default",
    "aten._index_put_impl_.default",
    "aten.index_add.default",
    "aten.take.default",
}


@dataclass(frozen=True)
class Coupling:
    """What ``coupling`` found: ``mixes``, the first forward op that mixes the samples of the batch (its name,
    target and module, and how), or None; ``unknown``, the ops it could not follow the batch through (each
    described alike), whose outputs it did not follow further."""

    mixes: str | None = None
    unknown: tuple[str, ...] = ()


def mixes_samples(planned: Planned, batched: Sequence[bool]) -> str | None:
    """The first forward op of ``planned``'s graph that mixes the samples of the batch, or None (``coupling``)."""
    return coupling(planned, batched).mixes


def coupling(planned: Planned, batched: Sequence[bool]) -> Coupling:
    """Follow the batch through ``planned``'s forward graph (the module docstring). ``batched``: which user
    inputs carry the batch on dim 0 (``batched_inputs``)."""
    gm, ctx = planned.graph, planned.ctx
    cached = ctx.cache.enumerator if ctx.cache is not None else None  # (what planning asked DTensor already)
    en = cached if cached is not None else CandidateEnumerator(ctx)
    axes = len(ctx.mesh_shape)
    batch_dim: dict[str, tuple[int | None, ...]] = {}  # node -> per output: the dim holding the batch (None: none)
    reduced: set[str] = set()  # values summed over the batch (a scalar on its way to the loss)
    unknown: list[str] = []
    iota = IotaTracker()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            role = node.meta.get("autoshard_role")
            if role is not None and role.kind == "input" and role.index < len(batched) and batched[role.index]:
                batch_dim[node.name] = (0,)
                iota.add_batch(node.meta["val"].shape[0])
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
        iota.visit(node)
        args = tensor_args(node)
        carried = {k: batch_dim[a.name][0] for k, a in enumerate(args) if batch_dim.get(a.name, (None,))[0] is not None}
        from_sum = any(a.name in reduced for a in args)
        outs = output_vals(node)
        scalar = all(v is None or v.ndim == 0 for v in outs)
        if from_sum and (carried or not scalar):
            return Coupling(_where(node, "combines a sum over the batch with per-sample values"), tuple(unknown))
        if from_sum:
            reduced.add(node.name)
            continue
        if not carried:
            continue
        picked = iota.index_dim(node, carried)
        if picked is not None:  # each sample's own row picked by an arange over the batch
            batch_dim[node.name] = (picked,)
            continue
        verdict = _through(en, node, carried, axes, reduced)
        if isinstance(verdict, tuple):
            batch_dim[node.name] = verdict
        elif verdict.startswith("?"):
            unknown.append(_where(node, verdict[1:]))
        else:
            return Coupling(_where(node, verdict), tuple(unknown))
    return Coupling(None, tuple(unknown))


def _through(
    en: CandidateEnumerator, node: fx.Node, carried: dict[int, int], axes: int, reduced: set[str]
) -> tuple[int | None, ...] | str:
    """Where the batch goes through ``node`` (per output: its batch dim or None), or why it cannot: a reason
    (mixing), or one starting with "?" (unknown). Scalar sums over the batch (the loss) join ``reduced``."""
    outs = output_vals(node)
    own = _own_rule(node, carried)
    if isinstance(own, tuple):
        return own
    k, dim = next(iter(carried.items()))
    have = (Shard(dim),) + (Replicate(),) * (axes - 1)
    raw = en.follow(node, k, have)
    if raw is None:
        return own or "?has no sharding rule (DTensor's or autoshard's) to follow the batch through"
    gathered = [j for j, d in carried.items() if not _on(raw.inputs[j], d)]
    if gathered:
        if str(node.target) in _MOVERS:
            return (
                f"?moves values across the batch (input {gathered[0]} gathered): "
                "whether it keeps samples apart is unknown"
            )
        return (
            "needs the whole batch at once" if gathered == [k] else f"combines the samples of its input {gathered[0]}"
        )
    dims: list[int | None] = []
    for pl, v in zip(raw.outputs, outs):
        first = None if pl is None else pl[0]
        if isinstance(first, Shard):
            dims.append(first.dim)
        elif first is not None and first.is_partial() and v is not None and v.ndim == 0:
            reduced.add(node.name)  # the loss (a mean or sum over the batch)
            dims.append(None)
        elif first is not None and first.is_partial():
            return "sums over the batch into a non-scalar"
        elif v is not None and isinstance(v, torch.Tensor) and v.ndim and first is not None:
            return "makes a value every sample reads"
        else:
            dims.append(None)
    return tuple(dims)


def _on(placements: Sequence | None, dim: int) -> bool:
    return placements is not None and placements[0] == Shard(dim)


def _own_rule(node: fx.Node, carried: dict[int, int]) -> tuple[int | None, ...] | str | None:
    """The batch through an op with a rule of ours that gives candidates (``autoshard/rules``), read on one mesh
    axis: a candidate with every batched input on its batch dim and every other input whole; its sharded
    outputs carry the batch on, its whole ones (a kernel's rng state) carry none. None: no such rule (DTensor's
    strategies serve the op). An unknown ("?...") when no candidate keeps the batch split: the rule may not offer
    a layout that is nonetheless per-sample (a grouped expert matmul's rows)."""
    rule = op_rules.rule_for(node.target)
    if rule is None or rule.candidates is None:
        return None
    ins = tensor_args(node)
    for c in rule.candidates(node, (0,)):  # (one axis: the candidates of one choice)
        if all(
            _on(pl, carried[i]) if i in carried else pl is None or pl[0] == Replicate()
            for i, pl in enumerate(c.inputs[: len(ins)])
        ):
            if any(pl is not None and pl[0].is_partial() for pl in c.outputs):
                continue
            return tuple(pl[0].dim if pl is not None and isinstance(pl[0], Shard) else None for pl in c.outputs)
    return f"?has no layout in autoshard's {rule.name} rule that keeps the batch split"


def _where(node: fx.Node, what: str) -> str:
    module = node.meta.get("autoshard_module", "")
    shapes = ", ".join(str(list(a.meta["val"].shape)) for a in tensor_args(node))
    return f"{node.target} ({node.name}{f' in {module}' if module else ''}, inputs {shapes}) {what}"
