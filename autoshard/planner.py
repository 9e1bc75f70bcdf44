"""The compiler pipeline as one visible, ordered list, and the Plan it produces.

    capture -> coarsen -> share_layers -> strategies -> solve        (planning: ``autoshard.plan``)
    -> lower -> partition + compile                                   (running: ``autoshard.compile``)

Each pass is ``pass(gm, ctx) -> gm``; the runner times and logs every pass, can dump the graph after each
(``AUTOSHARD_DEBUG=1``) and skips passes named in ``PlanConfig.disable_passes`` where skipping is meaningful
(``coarsen``: every node decides alone; ``share_layers``: no shared variables).
"""

from __future__ import annotations

import logging
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
from autoshard.passes.coarsen import coarsen, tensor_args
from autoshard.passes.context import PassContext, debug_enabled
from autoshard.passes.share_layers import share_layers
from autoshard.passes.solve import solve
from autoshard.passes.strategies import strategies
from autoshard.plan import (
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
) -> tuple[fx.GraphModule, PassContext]:
    ctx = PassContext(mesh=mesh, cluster=cluster, config=config, broadcast_solution=broadcast_solution)
    with tc.outside_local_tensor_mode():
        with ctx.timed("capture"):
            gm = capture(model, example_inputs, ctx)
        _dump(gm, "capture")
        for name, p in PLANNING_PASSES:
            with ctx.timed(name):
                gm = p(gm, ctx)
            _dump(gm, name)
    return gm, ctx


def _dump(gm: fx.GraphModule, name: str) -> None:
    if debug_enabled():
        log.info("graph after %s:\n%s", name, gm.graph)


def _pl(ps: Sequence | None) -> tuple[str, ...]:
    return tuple(placement_str(p) for p in ps) if ps is not None else ()


def _dtype(v: torch.Tensor) -> str:
    return str(v.dtype).replace("torch.", "")


def build_plan(gm: fx.GraphModule, ctx: PassContext) -> Plan:
    """The Plan value of a solved graph: layouts, decisions, collectives, predicted time and memory."""
    sol = ctx.solution
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
    params = grads = opt = acts = 0
    for g in ctx.groups:
        s = ctx.strategies[g.id][sol.choice[g.id]]
        compute += s.compute_s
        params += s.param_bytes
        grads += s.grad_bytes
        opt += s.optimizer_bytes
        acts += s.activation_bytes
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
    comm = sum(c.time_s for c in collectives)
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
        comm_s=comm,
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
    return Plan(mesh=mesh, cluster=ctx.cluster.name, stages=(stage,), step_time_s=compute + comm, solver=stats)


def _collectives(gm: fx.GraphModule, ctx: PassContext) -> list[CollectiveStat]:
    """Every placement change the chosen plan makes, as the collectives DTensor runs for it."""
    names = ctx.mesh_names
    out: list[CollectiveStat] = []

    def add(src: fx.Node, a: Sequence, b: Sequence, consumer: str, phase: str) -> None:
        if a is None or b is None or tuple(a) == tuple(b):
            return
        v = src.meta["val"]
        for st in redistribute_steps(tuple(a), tuple(b), tuple(v.shape), v.element_size(), ctx.mesh_shape, ctx.cluster):
            out.append(CollectiveStat(st.kind, names[st.axis], int(st.nbytes), float(st.time), src.name, consumer, phase))

    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        sh = node.meta["autoshard"]
        phase = node.meta.get("autoshard_phase", "forward")
        for k, src in enumerate(tensor_args(node)):
            add(src, src.meta["autoshard"].outputs[0], sh.inputs[k], node.name, phase)
    out_node = gm.graph.find_nodes(op="output")[0]
    rep = tuple(Replicate() for _ in ctx.mesh_shape)
    params = {n.meta["autoshard_role"].name: n for n in gm.graph.find_nodes(op="placeholder")}
    for src, role in zip(out_node.args[0], ctx.output_roles):
        if not isinstance(src, fx.Node):
            continue
        have = src.meta["autoshard"].outputs[0]
        if role.kind in ("loss", "output"):
            add(src, have, rep, "output", "forward")
        elif role.kind == "grad":
            add(src, have, params[role.name].meta["autoshard"].outputs[0], role.name, "backward")
    return out


def plan_graph(
    model: nn.Module,
    example_inputs: Sequence[Any],
    mesh: DeviceMesh,
    cluster: ClusterProfile,
    config: PlanConfig,
    broadcast_solution: bool = False,
) -> tuple[Plan, fx.GraphModule, PassContext]:
    t0 = time.perf_counter()
    gm, ctx = run_planning(model, example_inputs, mesh, cluster, config, broadcast_solution)
    plan = build_plan(gm, ctx)
    ctx.timings["total"] = time.perf_counter() - t0
    log.info("plan: predicted step %.6f s, %s", plan.step_time_s, ", ".join(f"{k} {v:.2f}s" for k, v in ctx.timings.items()))
    return plan, gm, ctx


__all__ = ["PLANNING_PASSES", "build_plan", "plan_graph", "run_planning"]
