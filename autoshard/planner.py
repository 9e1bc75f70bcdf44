"""The compiler pipeline as one visible, ordered list, and the Plan it produces.

    capture -> coarsen -> share_layers -> strategies -> solve        (planning: ``autoshard.plan``)
    -> lower -> partition + compile                                   (running: ``autoshard.compile``)

Each pass is ``pass(gm, ctx) -> gm``; the runner times and logs every pass, can dump the graph after each
(``AUTOSHARD_DEBUG=1``) and skips passes named in ``PlanConfig.disable_passes`` where skipping is meaningful
(``coarsen``: every node decides alone; ``share_layers``: no shared variables).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import operator
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate

from autoshard import _torch_compat as tc
from autoshard.cluster import ClusterProfile
from autoshard.config import PlanConfig
from autoshard.cost.comm import redistribute_steps
from autoshard.notation import placement_str
from autoshard.passes.capture import capture
from autoshard.ir import tensor_args
from autoshard.passes.coarsen import coarsen
from autoshard.passes.context import PassContext, debug_enabled
from autoshard.passes.share_layers import share_layers
from autoshard.passes.solve import annotate, solve
from autoshard.solver.intra_op import GRAD_SINK_CREDIT
from autoshard.passes.strategies import strategies
from autoshard.plan import (
    BaselineSummary,
    CollectiveStat,
    MemoryBreakdown,
    MeshSpec,
    OpDecision,
    Plan,
    SolverStats,
    StagePlan,
    TensorLayout,
)

log = logging.getLogger(__name__)

Pass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]

PLANNING_PASSES: tuple[tuple[str, Pass], ...] = (
    ("coarsen", coarsen),
    ("share_layers", share_layers),
    ("strategies", strategies),
    ("solve", solve),
)


def run_planning(
    model: nn.Module,
    example_inputs: Sequence[Any],
    mesh: DeviceMesh,
    cluster: ClusterProfile,
    config: PlanConfig,
    broadcast_solution: bool = False,
    progress: Any = None,
    stage: bool = False,
) -> tuple[fx.GraphModule, PassContext]:
    ctx = PassContext(mesh=mesh, cluster=cluster, config=config, broadcast_solution=broadcast_solution,
                      progress=progress, stage=stage)
    with tc.outside_local_tensor_mode():
        with ctx.timed("capture"):
            gm = _capture(model, example_inputs, ctx)
        _dump(gm, "capture")
        params = [n for n, _ in model.named_parameters(remove_duplicate=False)]
        if not stage:  # a pipeline stage holds part of the model: its constraints were checked on the whole
            config.check_constraints(params, ctx.signature.names if ctx.signature else (), ctx.mesh_names)
        for name, p in PLANNING_PASSES:
            with ctx.timed(name):
                gm = p(gm, ctx)
            _dump(gm, name)
    return gm, ctx


def _param_modules(model: nn.Module) -> dict[str, str]:
    return {
        f"{mn}.{pn}" if mn else pn: type(m).__name__
        for mn, m in model.named_modules()
        for pn, _ in m.named_parameters(recurse=False)
    }


def _layer_signature(m: nn.Module) -> tuple:
    return (type(m), tuple((n, tuple(p.shape), p.dtype) for n, p in m.named_parameters()))


def repeated_layers(model: nn.Module) -> tuple[str, int] | None:
    """The longest ``nn.ModuleList`` of identical blocks (same class, same parameter shapes): (path, length)."""
    best: tuple[str, int] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 1:
            first = _layer_signature(mod[0])
            if all(_layer_signature(c) == first for c in mod) and (best is None or len(mod) > best[1]):
                best = (name, len(mod))
    return best


def pipeline_layers(model: nn.Module) -> tuple[str, int] | None:
    """Where pipeline stages are cut: the repeated layers, else the longest ``nn.ModuleList`` of blocks of one
    class (T5's first block also holds the relative position table, so its blocks are not identical)."""
    found = repeated_layers(model)
    if found is not None:
        return found
    best: tuple[str, int] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 1 and len({type(c) for c in mod}) == 1:
            if best is None or len(mod) > best[1]:
                best = (name, len(mod))
    return best


def _truncated(model: nn.Module, path: str, keep: int) -> nn.Module:
    """A shallow copy of ``model`` whose ModuleList at ``path`` holds only its first ``keep`` blocks (the
    blocks, parameters and everything else are shared with ``model``, not copied)."""
    parts = path.split(".") if path else []
    root = copy.copy(model)
    root._modules = dict(model._modules)
    parent = root
    for part in parts[:-1]:
        child = copy.copy(parent._modules[part])
        child._modules = dict(child._modules)
        parent._modules[part] = child
        parent = child
    parent._modules[parts[-1]] = nn.ModuleList(list(parent._modules[parts[-1]])[:keep])
    return root


def _constraints_uneven(model: nn.Module, path: str, total: int, config: PlanConfig) -> str | None:
    """A constraint over parameter names that pins some of the repeated layers at ``path`` but not the same
    parameters in all of them (``model.layers.1*.mlp.*``): the captured layers could not stand for the rest.
    Returns that constraint's key, or None."""
    import fnmatch

    keys = [k for k in config.constraints if k not in ("inputs", "params") and not k.startswith("input[")]
    if not keys:
        return None
    prefix = f"{path}."
    rel: dict[int, list[str]] = {i: [] for i in range(total)}
    for name, _ in model.named_parameters(remove_duplicate=False):
        if name.startswith(prefix):
            idx, _, tail = name[len(prefix):].partition(".")
            if idx.isdigit():
                rel[int(idx)].append(tail)
    for key in keys:
        pinned = {frozenset(t for t in tails if fnmatch.fnmatchcase(f"{prefix}{i}.{t}", key)) for i, tails in rel.items()}
        if len(pinned) > 1:
            return key
    return None


def _capture(model: nn.Module, example_inputs: Sequence[Any], ctx: PassContext) -> fx.GraphModule:
    """Capture the whole model, or (``config.sample_layers``) only the first few of its repeated layers."""
    k = ctx.config.sample_layers
    found = repeated_layers(model) if k and ctx.config.share_layers else None
    if found is not None and found[0]:
        uneven = _constraints_uneven(model, found[0], found[1], ctx.config)
        if uneven is not None:
            log.info("capture: constraint %r pins some of the layers in %s but not others; capturing every layer",
                     uneven, found[0])
            found = None
    if found is not None and found[1] > k and found[0]:
        path, total = found
        try:
            short = _truncated(model, path, k)
            ctx.param_modules = _param_modules(short)
            ctx.sampled_layers = (path, k, total)
            gm = capture(short, example_inputs, ctx)
            log.info("capture: %d of the %d identical layers in %s captured; they stand for all", k, total, path)
            return gm
        except Exception as e:  # a forward that needs all its layers (indexes them, checks the count ...)
            log.warning("capture: could not trace %s with %d of its %d layers (%s: %s); capturing every layer",
                        path, k, total, type(e).__name__, str(e)[:200])
            ctx.sampled_layers = None
    ctx.param_modules = _param_modules(model)
    return capture(model, example_inputs, ctx)


def _dump(gm: fx.GraphModule, name: str) -> None:
    if debug_enabled():
        log.info("graph after %s:\n%s", name, gm.graph)


def _pl(ps: Sequence | None) -> tuple[str, ...]:
    return tuple(placement_str(p) for p in ps) if ps is not None else ()


def _dtype(v: torch.Tensor) -> str:
    return str(v.dtype).replace("torch.", "")


def _weight_of(gm_nodes: dict[str, fx.Node], name: str, ctx: PassContext) -> float:
    sh = gm_nodes[name].meta.get("autoshard")
    return ctx.group_weight.get(sh.group, 1.0) if sh is not None else 1.0


def build_plan(gm: fx.GraphModule, ctx: PassContext, solution: Any = None, recipe: str = "") -> Plan:
    """The Plan value of a solved graph: layouts, decisions, collectives, predicted time and memory.

    ``solution`` (default ``ctx.solution``) must be the one written onto the nodes (``passes.solve.annotate``).
    """
    sol = solution if solution is not None else ctx.solution
    nodes = {n.name: n for n in gm.graph.nodes}
    names = ctx.mesh_names
    mesh = MeshSpec(ctx.mesh_shape, names)
    tensors = []
    for n in gm.graph.find_nodes(op="placeholder"):
        role = n.meta["autoshard_role"]
        if role.kind == "tangent":
            continue
        v = n.meta["val"]
        tensors.append(TensorLayout(role.name, role.kind, tuple(v.shape), _dtype(v), _pl(n.meta["autoshard"].outputs[0])))
    ops = []
    compute = 0.0
    params = grads = opt = acts = 0.0
    for g in ctx.groups:
        s = ctx.strategies[g.id][sol.choice[g.id]]
        w = ctx.group_weight.get(g.id, 1.0)
        compute += w * s.compute_s  # moves inside a group (s.comm_s) are in the collectives list below
        params += w * s.param_bytes
        grads += w * s.grad_bytes
        opt += w * s.optimizer_bytes
        acts += w * s.activation_bytes
        if g.kind in ("op",):
            a = nodes[g.anchor]
            v = a.meta["val"]
            v0 = v if isinstance(v, torch.Tensor) else next((x for x in v if isinstance(x, torch.Tensor)), None)
            ops.append(
                OpDecision(
                    node=g.anchor,
                    op=str(a.target),
                    module=g.module,
                    phase=g.phase,
                    shape=tuple(v0.shape) if v0 is not None else (),
                    output=_pl(s.outputs[0][0]),
                    inputs=tuple(_pl(p) for p in s.inputs[0]),
                    compute_s=s.compute_s,
                    group_size=len(g.members),
                    dtype=_dtype(v0) if v0 is not None else "",
                )
            )
    collectives = _collectives(gm, ctx)
    comm = sum(c.time_s * c.repeat for c in collectives)
    # the solver's overlap credit (GRAD_SINK_CREDIT): part of each gradient reduction hides behind backward
    hidden = GRAD_SINK_CREDIT * sum(c.time_s * c.repeat for c in collectives if c.consumer in ctx.param_modules)
    memory = MemoryBreakdown(params, grads, opt, acts)
    stage = StagePlan(
        index=0,
        mesh=mesh,
        ranks=tuple(range(mesh.size)),
        layers=(),
        tensors=tuple(tensors),
        ops=tuple(ops),
        collectives=tuple(collectives),
        memory=memory,
        compute_s=compute,
        comm_s=comm - hidden,
    )
    stats = SolverStats(
        status=sol.status,
        objective_s=sol.objective_s,
        bound_s=sol.bound_s,
        wall_s=sol.wall_s,
        groups=len(ctx.groups),
        variables=sol.variables,
        shared_layers=int(ctx.stats.get("shared_layers", 0)),
    )
    sampled = ""
    if ctx.sampled_layers is not None:
        path, k, total = ctx.sampled_layers
        sampled = f"{path}: {k} of {total} identical layers captured, the rest costed as copies of them"
    return Plan(
        mesh=mesh,
        cluster=ctx.cluster.name,
        stages=(stage,),
        step_time_s=compute + comm - hidden,
        solver=stats,
        recipe=recipe,
        hidden_comm_s=hidden,
        memory_budget_bytes=int(ctx.config.memory_budget or 0),
        sampled_layers=sampled,
    )


def _collectives(gm: fx.GraphModule, ctx: PassContext) -> list[CollectiveStat]:
    """Every placement change the chosen plan makes, as the collectives DTensor runs for it."""
    names = ctx.mesh_names
    nodes = {n.name: n for n in gm.graph.nodes}
    out: list[CollectiveStat] = []

    def add(src: fx.Node, a: Sequence, b: Sequence, consumer: str, phase: str, repeat: float) -> None:
        if a is None or b is None or tuple(a) == tuple(b):
            return
        v = src.meta["val"]
        for st in redistribute_steps(tuple(a), tuple(b), tuple(v.shape), v.element_size(), ctx.mesh_shape, ctx.cluster):
            out.append(CollectiveStat(st.kind, names[st.axis], int(st.nbytes), float(st.time), src.name, consumer,
                                      phase, repeat))

    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        sh = node.meta["autoshard"]
        phase = node.meta.get("autoshard_phase", "forward")
        w = ctx.group_weight.get(sh.group, 1.0)
        for k, src in enumerate(tensor_args(node)):
            add(src, src.meta["autoshard"].outputs[0], sh.inputs[k], node.name, phase, w)
    out_node = gm.graph.find_nodes(op="output")[0]
    rep = tuple(Replicate() for _ in ctx.mesh_shape)
    params = {n.meta["autoshard_role"].name: n for n in gm.graph.find_nodes(op="placeholder")}
    for src, role in zip(out_node.args[0], ctx.output_roles):
        if not isinstance(src, fx.Node):
            continue
        have = src.meta["autoshard"].outputs[0]
        w = _weight_of(nodes, src.name, ctx)
        if role.kind in ("loss", "output"):
            add(src, have, rep, "output", "forward", w)
        elif role.kind in ("grad", "input_grad"):
            add(src, have, params[role.name].meta["autoshard"].outputs[0], role.name, "backward", w)
    return out


def baseline_summaries(gm: fx.GraphModule, ctx: PassContext) -> tuple[BaselineSummary, ...]:
    """Each recipe's Plan-level numbers (same accounting as the plan), computed from ``ctx.baselines``."""
    out = []
    for r in ctx.baselines:
        if r.solution is None:
            out.append(BaselineSummary(r.name, math.inf, 0, False, r.note))
            continue
        annotate(gm, ctx, r.solution)
        p = build_plan(gm, ctx, r.solution, recipe=r.name)
        out.append(BaselineSummary(r.name, p.step_time_s, p.peak_memory.total, r.fits, r.note))
    annotate(gm, ctx)
    return tuple(out)


def plan_graph(
    model: nn.Module,
    example_inputs: Sequence[Any],
    mesh: DeviceMesh,
    cluster: ClusterProfile,
    config: PlanConfig,
    broadcast_solution: bool = False,
    progress: Any = None,
    stage: bool = False,
) -> tuple[Plan, fx.GraphModule, PassContext]:
    """Plan ``model``; ``stage=True`` plans a pipeline stage (tensor outputs, input gradients; see capture)."""
    t0 = time.perf_counter()
    gm, ctx = run_planning(model, example_inputs, mesh, cluster, config, broadcast_solution, progress, stage)
    plan = build_plan(gm, ctx, recipe=ctx.config.recipe or "")
    if ctx.baselines:
        plan = dataclasses.replace(plan, baselines=baseline_summaries(gm, ctx))
    ctx.timings["total"] = time.perf_counter() - t0
    log.info("plan: predicted step %.6f s, %s", plan.step_time_s, ", ".join(f"{k} {v:.2f}s" for k, v in ctx.timings.items()))
    return plan, gm, ctx


__all__ = ["PLANNING_PASSES", "build_plan", "pipeline_layers", "plan_graph", "repeated_layers", "run_planning"]
