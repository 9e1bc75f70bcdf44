"""Gradient accumulation without pipeline stages (``compile(..., microbatches=k)`` on a mesh with no ``pp`` axis).

The program is planned and compiled for ONE micro-batch (the global batch cut into ``k`` along dim 0).
``ShardedModule.step`` takes the global batch, cuts it into ``k`` micro-batches, runs forward and backward on
each (autograd accumulates the gradients into ``.grad``) and weights each micro-batch's loss so that the loss it
returns and the gradients equal one step on the whole batch:

- a mean over counted targets (cross-entropy / NLL with ``ignore_index``; padding labels ``-100``): micro-batch
  ``i`` counts ``c_i`` targets, its loss is weighted ``c_i / sum(c)``;
- a sum (``reduction="sum"``, ``x.sum()``): weight 1;
- a mean over equally sized micro-batches (``mse_loss``, ``x.mean()``) and any loss not recognised: ``1 / k``.

The loss's kind is read off the captured joint graph (``loss_weighting``): its loss output, through views and
scalings, ends in ``div(sum, total_weight)`` of an ``nll_loss_forward`` (how cross-entropy decomposes), an op
with a ``reduction`` argument, or a ``mean`` / ``sum``. The target count is a small FX graph of the model inputs
cut out of the joint graph (the target's ancestors), run on each micro-batch's global tensors.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from autoshard import _torch_compat as tc
from autoshard.errors import CallError, InputError
from autoshard.ir import kept_target_counter, node_arg

if TYPE_CHECKING:
    from autoshard.plans.plan import Plan

log = logging.getLogger(__name__)

aten = torch.ops.aten

MEAN_COUNTED, SUM, MEAN = "mean over counted targets", "sum", "mean"

# ops that keep how the loss depends on the batch: views, copies, dtype casts
_PASS_THROUGH = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.unsqueeze.default,
    aten.clone.default,
    aten._to_copy.default,
    aten.alias.default,
    aten.detach.default,
    aten.contiguous.default,
}
_SCALE = {aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar}  # by a Python number: kept
_NLL = {aten.nll_loss_forward.default, aten.nll_loss2d_forward.default}
_REDUCTION = {0: "none", 1: MEAN, 2: SUM}  # aten's reduction enum


@dataclass(frozen=True)
class LossWeighting:
    """How the micro-batches' losses add up to the whole batch's: ``kind`` (``MEAN_COUNTED``, ``SUM``, ``MEAN``)
    and, for ``MEAN_COUNTED``, the graph inputs the count reads and the count's graph."""

    kind: str
    counter: fx.GraphModule | None = None
    counter_inputs: tuple[int, ...] = ()

    def count(self, tensors: Sequence[torch.Tensor]) -> float:
        """The targets one micro-batch's loss averages over (its global tensors, graph-input order)."""
        assert self.counter is not None
        with tc.outside_local_tensor_mode():
            return float(self.counter(*[tensors[i] for i in self.counter_inputs]))


@dataclass(frozen=True)
class Accumulation:
    """What ``ShardedModule.step`` needs to run one step as ``microbatches`` micro-batches."""

    microbatches: int
    batched: tuple[bool, ...]  # per graph input: cut along dim 0 (else passed whole to every micro-batch)
    weighting: LossWeighting

    def split(self, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
        """The global call's tensors as ``microbatches`` micro-batches (views along dim 0)."""
        if len(tensors) != len(self.batched):
            raise CallError(
                f"the call has {len(tensors)} tensor inputs; the program was traced with {len(self.batched)}"
            )
        check_divides(names, tensors, self.batched, self.microbatches)
        k = self.microbatches
        with tc.outside_local_tensor_mode():
            cut = [torch.tensor_split(t, k) if b else (t,) * k for t, b in zip(tensors, self.batched)]
        return [[c[i] for c in cut] for i in range(k)]

    def weights(self, micro: Sequence[Sequence[torch.Tensor]]) -> list[float]:
        """Per micro-batch, the factor on its loss such that their weighted sum is the whole batch's loss."""
        k = len(micro)
        w = self.weighting
        if w.kind == SUM:
            return [1.0] * k
        if w.kind == MEAN_COUNTED:
            counts = [w.count(m) for m in micro]
            total = sum(counts)
            if total > 0:
                return [c / total for c in counts]
        return [1.0 / k] * k


def batched_inputs(tensors: Sequence[torch.Tensor]) -> tuple[bool, ...]:
    """Which tensor inputs carry the batch on dim 0: every tensor with a dim 0, except a size-1 dim 0 next to a
    larger batch (broadcast along the batch, e.g. ``position_ids`` of shape ``(1, T)``)."""
    sizes = [t.shape[0] for t in tensors if t.ndim]
    batch = max(sizes, default=0)
    return tuple(bool(t.ndim) and not (t.shape[0] == 1 and batch > 1) for t in tensors)


def check_divides(names: Sequence[str], tensors: Sequence[torch.Tensor], batched: Sequence[bool], k: int) -> None:
    """A clear error when ``k`` micro-batches do not divide the batch (dim 0) of every batched input."""
    if k < 1:
        raise InputError(f"microbatches={k}: use a positive number of micro-batches")
    for name, t, b in zip(names, tensors, batched):
        if b and t.shape[0] % k:
            raise InputError(
                f"microbatches={k}: argument {name} has batch size {t.shape[0]} (dim 0 of shape {tuple(t.shape)}), "
                f"which {k} micro-batches do not divide; use a number of micro-batches that divides {t.shape[0]}"
            )


def micro_example(signature: Any, tensors: Sequence[torch.Tensor], k: int) -> Any:
    """The first of ``k`` micro-batches of a call (batched tensors cut along dim 0), shaped like the call:
    positional tensors as a tuple, else an ``autoshard.inputs.Call``."""
    from autoshard.inputs import Call

    batched = batched_inputs(tensors)
    check_divides(signature.names, tensors, batched, k)
    with tc.outside_local_tensor_mode():
        cut = [t[: t.shape[0] // k] if b else t for t, b in zip(tensors, batched)]
    args, kwargs = signature.unflatten(cut)
    return Call(args, kwargs) if kwargs else args


# ------------------------------------------------------------------------------- the loss's kind


def _strip(node: Any) -> Any:
    """Through views, casts and scalings by a Python number to the node that makes the loss."""
    while isinstance(node, fx.Node) and node.op == "call_function":
        if node.target in _PASS_THROUGH:
            node = node.args[0]
        elif node.target in _SCALE and not isinstance(node.args[1], fx.Node):
            node = node.args[0]
        else:
            break
    return node


def _getitem_of(node: Any, index: int) -> fx.Node | None:
    """``x`` when ``node`` is ``getitem(x, index)`` of an NLL forward, else None."""
    if (
        isinstance(node, fx.Node)
        and node.op == "call_function"
        and node.target is operator.getitem
        and node.args[1] == index
        and isinstance(node.args[0], fx.Node)
        and node.args[0].target in _NLL
    ):
        return node.args[0]
    return None


def _target_counter(gm: fx.GraphModule, nll: fx.Node) -> LossWeighting | None:
    """A graph of the model inputs counting the targets ``nll`` averages over (``target != ignore_index``), or
    None when the targets depend on more than the inputs or the classes are weighted."""
    if node_arg(nll, 2, "weight", None) is not None:
        return None
    target, ignore = nll.args[1], node_arg(nll, 4, "ignore_index", -100)
    counter, used = kept_target_counter(gm, target, ignore)
    inputs: list[int] = []
    for n in used:
        role = n.meta.get("autoshard_role")
        if role is None or role.kind != "input":
            return None  # the targets depend on a parameter or buffer
        inputs.append(role.index)
    return LossWeighting(MEAN_COUNTED, counter, tuple(inputs))


def loss_weighting(gm: fx.GraphModule, output_roles: Sequence[Any]) -> LossWeighting:
    """How the loss of the captured joint graph ``gm`` adds up over micro-batches (see the module docstring)."""
    outs = gm.graph.find_nodes(op="output")[0].args[0]
    loss = next(o for o, r in zip(outs, output_roles) if r.kind == "loss")
    root = _strip(loss)
    found: LossWeighting | None = None
    why = ""
    if isinstance(root, fx.Node) and root.op == "call_function":
        if root.target in (aten.div.Tensor,) and isinstance(root.args[1], fx.Node):
            num, den = _getitem_of(_strip(root.args[0]), 0), _getitem_of(_strip(root.args[1]), 1)
            if num is not None and num is den:  # decomposed mean cross-entropy: sum / total_weight
                found = _target_counter(gm, num)
                why = "a class-weighted NLL or targets made from parameters"
        elif (nll := _getitem_of(root, 0)) is not None:
            kind = _REDUCTION.get(node_arg(nll, 3, "reduction", 1), MEAN)
            found = _target_counter(gm, nll) if kind == MEAN else LossWeighting(kind)
            why = "a class-weighted NLL or targets made from parameters"
        elif root.target in (aten.sum.default, aten.sum.dim_IntList):
            found = LossWeighting(SUM)
        elif root.target in (aten.mean.default, aten.mean.dim):
            found = LossWeighting(MEAN)
        elif hasattr(root.target, "_schema") and any(a.name == "reduction" for a in root.target._schema.arguments):
            names = [a.name for a in root.target._schema.arguments]
            kind = _REDUCTION.get(node_arg(root, names.index("reduction"), "reduction", 1), MEAN)
            found = LossWeighting(SUM if kind == SUM else MEAN)
    if found is None:
        log.info(
            "gradient accumulation: the loss (%s) is not a recognised mean or sum%s; the micro-batches' losses "
            "are averaged (exact for a mean over equally sized micro-batches)",
            getattr(root, "target", root),
            f" ({why})" if why else "",
        )
        return LossWeighting(MEAN)
    log.info("gradient accumulation: the loss is a %s (micro-batches weighted accordingly)", found.kind)
    return found


def accumulated_plan(plan: Plan, k: int) -> Plan:
    """A one-micro-batch ``plan`` as the step of ``k`` micro-batches: ``microbatches=k``; every time per
    micro-batch (compute, collectives, the recipes' steps) runs ``k`` times, the optimizer-phase gathers (ZeRO's
    masters back to the compute layout) once; memory is one micro-batch's (gradients accumulate in place)."""
    import dataclasses

    stage = plan.stages[0]
    once = sum(c.time_s * c.repeat for c in stage.collectives if c.phase == "optimizer")
    collectives = tuple(
        c if c.phase == "optimizer" else dataclasses.replace(c, repeat=c.repeat * k) for c in stage.collectives
    )
    stage = dataclasses.replace(
        stage,
        collectives=collectives,
        compute_s=stage.compute_s * k,
        comm_s=(stage.comm_s - once) * k + once,
        microbatch_time_s=plan.step_time_s,
        layer_times=tuple(dataclasses.replace(r, runs=r.runs * k) for r in stage.layer_times),
    )
    recipes = tuple(dataclasses.replace(r, step_time_s=r.step_time_s * k, microbatches=k) for r in plan.recipes)
    return dataclasses.replace(
        plan,
        stages=(stage,),
        microbatches=k,
        step_time_s=(plan.step_time_s - once) * k + once,
        hidden_comm_s=plan.hidden_comm_s * k,
        recipes=recipes,
    )


__all__ = [
    "MEAN",
    "MEAN_COUNTED",
    "SUM",
    "Accumulation",
    "LossWeighting",
    "accumulated_plan",
    "batched_inputs",
    "check_divides",
    "loss_weighting",
    "micro_example",
]
