"""A trained parameter's forms beyond its compute layout: ZeRO-1/2 and ZeRO-Offload (part of ``strategies``).

``strategies`` lists each parameter's compute layouts; for each, this module adds

- ``state_variants``: the ZeRO-1 and ZeRO-2 forms, the optimizer state (and, for ZeRO-2, the gradient) sharded
  further over the mesh axes where the compute layout is replicated, the stepped master gathered back once after
  each optimizer step (``after_step_gather``, bundled with every other parameter's: ``after_step_members``);
- ``offload_variants``: the ZeRO-Offload form (``PlanConfig.offload``), the master and its optimizer state in host
  memory, the host link's copies and the host's optimizer step priced in ``compute_s``; ``forced_offload`` keeps
  only such forms under ``offload="optimizer"`` / ``"params"``.

A frozen parameter (``ir.is_frozen``) has none of these forms: it holds no gradient and no optimizer state.
``offloaded_params`` and ``offload_summary`` read a solution's offloaded parameters back (the runtime's host
copies, the report's line).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from autoshard.buckets import gather_axes
from autoshard.compiler.candidates import evenly_divisible, shard_factor
from autoshard.compiler.context import PassContext
from autoshard.cost.offload import OffloadSummary, host_is_device, offload_cost
from autoshard.cost.reshard import reshard_time as redistribute_time
from autoshard.errors import InputError
from autoshard.ir import GroupStrategy


def state_variants(s: GroupStrategy, val: torch.Tensor, ctx: PassContext) -> list[GroupStrategy]:
    """ZeRO-1 and ZeRO-2 forms of a parameter candidate ``s`` whose compute layout is replicated on some mesh axes:
    the optimizer state (and, for ZeRO-2, the gradient) sharded further over every such axis, or over one of
    them; the parameter stays in its compute layout between steps (a copy gathered once after each optimizer
    step, whose all-gather is costed here) and the sharded master is what the optimizer steps."""
    ms = ctx.mesh_shape
    compute = s.outputs[0][0]
    free = [a for a, p in enumerate(compute) if isinstance(p, Replicate) and ms[a] > 1]
    subsets = [tuple(free)] + ([(a,) for a in free] if len(free) > 1 else [])
    size = val.numel() * val.element_size()
    out = []
    for axes in subsets:
        state = next(
            (
                st
                for d in range(val.ndim)
                for st in [tuple(Shard(d) if a in axes else p for a, p in enumerate(compute))]
                if evenly_divisible(val.shape, st, ms)
            ),
            None,
        )
        if state is None:
            continue
        gather = after_step_gather(state, compute, val, ctx)
        if math.isinf(gather):
            continue
        shard = size // shard_factor(state, ms)
        param = size // shard_factor(compute, ms) + shard  # the compute copy and the optimizer's master shard
        opt = shard * ctx.config.optimizer_factor
        for grad in (state, compute):  # ZeRO-2, ZeRO-1
            g = size // shard_factor(grad, ms)
            out.append(
                dataclasses.replace(
                    s,
                    comm_s=s.comm_s + gather,
                    state_bytes=param + g + opt,
                    param_bytes=param,
                    grad_bytes=g,
                    optimizer_bytes=opt,
                    grad_placements=grad,
                    state_placements=state,
                )
            )
    return out


def after_step_gather(state: tuple, compute: tuple, val: torch.Tensor, ctx: PassContext) -> float:
    """Seconds of a stepped master's gather from ``state`` back to its ``compute`` layout after the optimizer step.
    The runtime gathers the masters that only all-gather one dim together, one collective per mesh axes and dtype
    (``runtime.param_state``, ``buckets.gather_axes``): such a member pays its bytes at full bandwidth and its share
    of that collective's latency and sync, one in every parameter of the model (every layer a captured one stands
    for counted); any other move is paid whole."""
    ms, shape = ctx.mesh_shape, tuple(val.shape)
    if gather_axes(state, compute, shape, ms) is None:
        return redistribute_time(state, compute, shape, val.element_size(), ms, ctx.cluster)
    return redistribute_time(
        state, compute, shape, val.element_size(), ms, ctx.cluster, bundle_share=1.0 / after_step_members(ctx)
    )


def after_step_members(ctx: PassContext) -> float:
    """How many parameters the masters' gather after the optimizer step bundles, as the solver counts its shares:
    every parameter of the model (each layer a captured one stands for counted), at least 1."""
    return max(1.0, sum(ctx.group_weight.get(g.id, 1.0) for g in ctx.groups if g.kind == "parameter"))


def _full_state(compute: tuple, val: torch.Tensor, ms: tuple[int, ...]) -> tuple:
    """``compute`` sharded further over every mesh axis where it is replicated (on the first dim that divides
    evenly), or ``compute`` itself when no such shard exists."""
    free = [a for a, p in enumerate(compute) if isinstance(p, Replicate) and ms[a] > 1]
    for d in range(val.ndim):
        st = tuple(Shard(d) if a in free else p for a, p in enumerate(compute))
        if free and evenly_divisible(val.shape, st, ms):
            return st
    return compute


def offload_variants(s: GroupStrategy, val: torch.Tensor, ctx: PassContext) -> list[GroupStrategy]:
    """The ZeRO-Offload form of a parameter candidate ``s`` (``PlanConfig.offload``): its optimizer state and the
    master the optimizer updates live in host memory, sharded over every mesh axis where the compute layout is
    replicated (each rank steps its shard); the device keeps the compute copy and the gradient until it is copied
    out. Per step: the gradient shard to the host, the host's optimizer step, the updated shard back and, when the
    compute copy is less sharded, its all-gather on the device (``autoshard/cost/offload.py``; in ``compute_s``,
    since the runtime overlaps none of it). Device bytes: compute copy + gradient, no optimizer state; host bytes:
    master + its gradient + optimizer state. With ``offload="params"`` only compute layouts sharded over every
    axis (ZeRO-3 / FSDP, as DeepSpeed's parameter offload requires) are offered, so the device holds a shard of
    the parameter and nothing else."""
    mode = ctx.config.offload
    factor = ctx.config.optimizer_factor
    shared = host_is_device(ctx.cluster)  # a CPU cluster: host memory is the device's own, offloading frees nothing
    if mode == "none" or factor == 0 or (shared and mode == "auto"):
        return []
    ms = ctx.mesh_shape
    compute = s.outputs[0][0]
    state = _full_state(compute, val, ms) if ctx.config.shard_state or mode == "params" else compute
    size = val.numel() * val.element_size()
    shard = size // shard_factor(state, ms)
    on_device = size // shard_factor(compute, ms)
    gather = after_step_gather(state, compute, val, ctx)
    if math.isinf(gather):
        return []
    cost = offload_cost(shard, shard, factor, ctx.cluster)
    moved = None if state == compute else state
    # where host memory is the device's (forced on a CPU cluster, to run the mechanism), the master and the state
    # stay in the device's count: the compute copy is then one more copy, not one fewer
    param, opt = (on_device + shard, shard * factor) if shared else (on_device, 0)
    return [
        dataclasses.replace(
            s,
            compute_s=s.compute_s + cost.total_s,
            comm_s=s.comm_s + gather,
            state_bytes=param + shard + opt,
            param_bytes=param,
            grad_bytes=shard,
            optimizer_bytes=opt,
            grad_placements=moved,
            state_placements=moved,
            offload="params" if mode == "params" else "optimizer",
            offload_s=cost.total_s,
            host_bytes=shard * (2 + factor),
        )
    ]


def forced_offload(result: dict[tuple, GroupStrategy], mode: str, ms: tuple[int, ...], name: str) -> dict:
    """Under ``offload="optimizer"`` / ``"params"`` only the offloaded candidates; for "params" those whose compute
    copy is sharded over every axis of size > 1, where the parameter has such a layout."""
    kept = {k: v for k, v in result.items() if v.offload}
    if not kept:
        raise InputError(
            f"offload={mode!r}: parameter {name} has no offloaded layout on mesh {ms} (the optimizer "
            "keeps no state, optimizer='none'?); use offload='auto' or 'none'"
        )
    if mode == "params":
        sharded = {
            k: v for k, v in kept.items() if all(isinstance(p, Shard) or n == 1 for p, n in zip(v.outputs[0][0], ms))
        }
        kept = sharded or kept
    return kept


def offloaded_params(gm: fx.GraphModule, ctx: PassContext, solution: object = None) -> dict[str, str]:
    """Parameter name -> offload mode of the parameters ``solution`` (default ``ctx.solution``) holds in host memory."""
    sol = solution if solution is not None else ctx.solution
    nodes = {n.name: n for n in gm.graph.nodes}
    out: dict[str, str] = {}
    for g in ctx.groups:
        if g.kind == "parameter" and (mode := ctx.strategies[g.id][sol.choice[g.id]].offload):
            out[nodes[g.anchor].meta["autoshard_role"].name] = mode
    return out


def offload_summary(gm: fx.GraphModule, ctx: PassContext, solution: object = None) -> OffloadSummary | None:
    """What ``solution`` (default ``ctx.solution``) holds in host memory, over every layer (shared layers weighted
    by the layers they stand for): None when nothing is offloaded."""
    sol = solution if solution is not None else ctx.solution
    found = [
        (ctx.strategies[g.id][sol.choice[g.id]], ctx.group_weight.get(g.id, 1.0))
        for g in ctx.groups
        if g.kind == "parameter"
    ]
    off = [(s, w) for s, w in found if s.offload]
    if not off:
        return None
    return OffloadSummary(
        mode=max({s.offload for s, _ in off}),
        params=round(sum(w for _, w in off)),
        total=round(sum(w for _, w in found)),
        host_bytes=int(sum(w * s.host_bytes for s, w in off)),
        step_s=sum(w * s.offload_s for s, w in off),
        link=ctx.cluster.host_link.name,
    )


__all__ = [
    "after_step_gather",
    "after_step_members",
    "forced_offload",
    "offload_summary",
    "offload_variants",
    "offloaded_params",
    "state_variants",
]
