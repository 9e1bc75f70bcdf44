"""One solve: the planning passes run once (``autoshard/compiler/runner.py``), the Plan value of the solved graph,
and the recipe fallback (the first search).

``plan_once`` runs capture .. solve and builds the ``Plan`` (layouts, decisions, collectives, predicted time and
memory, the recipes' numbers), returned with the graph and pass context as a :class:`Planned`; ``autoshard.compile``
then runs the program passes (lower .. compile) on that graph and context. When a recipe's layouts are predicted
faster than the solved plan's at the plan's own accounting, the recipe's are kept (``_keep_faster_recipe``).

The other searches run this more than once: recomputation mixes (``search/recompute.py``), gradient-accumulation
micro-batches (``search/accumulate.py``), autotuning (``search/autotune.py``) and pipeline stages
(``autoshard/pipeline/search.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autoshard.cluster.profile import ClusterProfile
from autoshard.compiler.capture_layers import copy_graph
from autoshard.compiler.capture_recompute import replay_time
from autoshard.compiler.context import PassContext, PlanningCache
from autoshard.compiler.plan_collectives import plan_collectives, weight_of
from autoshard.compiler.runner import PLANNING, run_passes
from autoshard.compiler.solve import annotate, problem_of
from autoshard.compiler.solve_reuse import program_fingerprint
from autoshard.config import PlanConfig
from autoshard.cost.memory import GraphWalk, graph_walk, temporaries, transients
from autoshard.ir import is_frozen, layer_key
from autoshard.notation import describe, placements_tuple
from autoshard.plans.explain import headline
from autoshard.plans.plan import (
    CollectiveStat,
    LayerTime,
    MemoryBreakdown,
    MeshSpec,
    OpDecision,
    Plan,
    RecipeSummary,
    SolverStats,
    StagePlan,
    TensorLayout,
    block_of,
)
from autoshard.solver.pricing import GRAD_SINK_CREDIT

if TYPE_CHECKING:
    from autoshard.solver.intra_op import Solution

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Planned:
    """A solved plan with what compiling it needs: the solved global graph (``meta["autoshard"]`` on its nodes)
    and the pass context the program passes continue from."""

    plan: Plan
    graph: fx.GraphModule
    ctx: PassContext

    def with_plan(self, plan: Plan) -> Planned:
        return dataclasses.replace(self, plan=plan)


def _dtype(v: torch.Tensor) -> str:
    return str(v.dtype).replace("torch.", "")


def layer_times(ctx: PassContext, sol: Solution, collectives: Sequence[CollectiveStat]) -> tuple[LayerTime, ...]:
    """The step of a solved graph per block, adding up to its compute plus its communication less the solver's
    overlap credit: each group's compute and each collective (by the module that waits for it) at their weights
    (a sampled layer runs for the copies it stands for: ``runs``); gradient reductions less the credit in the
    backward; the optimizer phase's work and gathers once a step."""
    acc: dict[str, list[float]] = {}  # block -> forward, backward, forward comm, backward comm, once, runs

    def row(block: str) -> list[float]:
        return acc.setdefault(block, [0.0, 0.0, 0.0, 0.0, 0.0, 1.0])

    for g in ctx.groups:
        w = ctx.group_weight.get(g.id, 1.0)
        r = row(block_of(g.module))
        r[5] = max(r[5], w)
        r[{"forward": 0, "backward": 1}.get(g.phase, 4)] += w * ctx.strategies[g.id][sol.choice[g.id]].compute_s
    for c in collectives:
        r = row(block_of(c.owner))
        t = c.time_s * c.repeat * ((1.0 - GRAD_SINK_CREDIT) if c.consumer in ctx.param_modules else 1.0)
        if c.phase == "optimizer":
            r[4] += t
        else:
            at = 0 if c.phase == "forward" else 1
            r[at] += t
            r[at + 2] += t
    order = sorted(acc, key=lambda b: (b != "outside the layers", layer_key(b) or (b, 0)))
    return tuple(
        LayerTime(b, f / n, bw / n, n, once, fc / n, bc / n) for b in order for f, bw, fc, bc, once, n in [acc[b]]
    )


def build_plan(
    gm: fx.GraphModule,
    ctx: PassContext,
    solution: Solution | None = None,
    recipe: str = "",
    walk: GraphWalk | None = None,
) -> Plan:
    """The Plan value of a solved graph: layouts, decisions, collectives, predicted time and memory.

    ``solution`` (default ``ctx.solution``) must be the one written onto the nodes (``compiler/solve.py: annotate``);
    ``walk``: the graph's ``cost.memory.graph_walk``, shared by the plans made of one graph.
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
        sh = n.meta["autoshard"]
        tensors.append(
            TensorLayout(
                role.name,
                role.kind,
                tuple(v.shape),
                _dtype(v),
                placements_tuple(sh.outputs[0]),
                placements_tuple(sh.grad) if sh.state is not None else (),
                placements_tuple(sh.state),
                sh.offload,
                frozen=is_frozen(n),
            )
        )
    ops = []
    compute = 0.0
    params = grads = opt = acts = host = offload_s = 0.0
    for g in ctx.groups:
        s = ctx.strategies[g.id][sol.choice[g.id]]
        w = ctx.group_weight.get(g.id, 1.0)
        compute += w * s.compute_s  # moves inside a group (s.comm_s) are in the collectives list below
        params += w * s.param_bytes
        grads += w * s.grad_bytes
        opt += w * s.optimizer_bytes
        acts += w * s.activation_bytes
        host += w * s.host_bytes
        offload_s += w * s.offload_s
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
                    output=placements_tuple(s.outputs[0][0]),
                    inputs=tuple(placements_tuple(p) for p in s.inputs[0]),
                    compute_s=s.compute_s,
                    group_size=len(g.members),
                    dtype=_dtype(v0) if v0 is not None else "",
                )
            )
    collectives = plan_collectives(gm, ctx)
    rows = layer_times(ctx, sol, collectives)
    comm = sum(c.time_s * c.repeat for c in collectives)
    # the solver's overlap credit (GRAD_SINK_CREDIT): part of each gradient reduction hides behind backward
    hidden = GRAD_SINK_CREDIT * sum(c.time_s * c.repeat for c in collectives if c.consumer in ctx.param_modules)
    factor = ctx.config.optimizer_factor
    t = transients(gm, ctx.mesh_shape, ctx.output_roles, weight=lambda n: weight_of(nodes, n.name, ctx), walk=walk)
    temps = temporaries(t, acts, opt / factor if factor else 0.0)
    memory = MemoryBreakdown(params, grads, opt, acts, temps, host)
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
        offload_s=offload_s,
        layer_times=rows,
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
        recompute=bool(ctx.config.recompute),
        recompute_layers=ctx.config.recompute,
        recompute_s=replay_time(gm, ctx.mesh_shape, ctx.cluster.device, ctx.group_weight)
        if ctx.config.recompute
        else 0.0,
        **ctx.config.precision_fields,
        fingerprint=program_fingerprint(gm, ctx),
    )


def recipe_summaries(gm: fx.GraphModule, ctx: PassContext, against: Plan | None = None) -> tuple[RecipeSummary, ...]:
    """Each recipe's Plan-level numbers (same accounting as the plan), computed from ``ctx.recipes``; with
    ``against`` (the plan), the largest terms of each recipe's difference with it (``plans/explain.py``)."""
    out = []
    walk = graph_walk(gm, ctx.output_roles)  # (the graph is the same for every recipe: only its layouts change)
    for r in ctx.recipes:
        if r.solution is None:
            out.append(RecipeSummary(r.name, math.inf, 0, False, r.note))
            continue
        annotate(gm, ctx, r.solution)
        p = build_plan(gm, ctx, r.solution, recipe=r.name, walk=walk)
        differences = headline(against, p) if against is not None else ()
        m = p.peak_memory
        out.append(
            RecipeSummary(
                r.name,
                p.step_time_s,
                m.total,
                r.fits,
                r.note,
                differences=differences,
                recompute=describe(ctx.config.recompute),
                state_bytes=m.state,
            )
        )
    annotate(gm, ctx)
    return tuple(out)


def _keep_faster_recipe(plan: Plan, gm: fx.GraphModule, ctx: PassContext) -> Plan:
    """``plan``, or the fastest fitting recipe's layouts where their plan-level step is shorter. The solver's
    objective prices a move per consumer edge; the plan counts the collectives the lowering makes (one move
    per value, layout and phase, reductions bundled per layer), so the two orders can disagree by a few
    percent, and a recipe whose objective is higher can run faster. Its solution is then the plan's."""
    if ctx.config.recipe is not None:
        return plan
    faster = [s for s in plan.recipes if s.fits and s.step_time_s < plan.step_time_s * (1 - 1e-9)]
    if not faster:
        return plan
    best = min(faster, key=lambda s: s.step_time_s)
    kept = next(r for r in ctx.recipes if r.name == best.name)
    log.info(
        "plan: the %s recipe's layouts step in %.6f s, the solved plan's in %.6f s; keeping the recipe's",
        best.name,
        best.step_time_s,
        plan.step_time_s,
    )
    ctx.solution = dataclasses.replace(
        kept.solution,
        status=f"{ctx.solution.status}, {best.name} kept",
        bound_s=ctx.solution.bound_s,
        variables=ctx.solution.variables,
    )
    annotate(gm, ctx)
    kept_plan = build_plan(gm, ctx, recipe="")
    return dataclasses.replace(kept_plan, recipes=recipe_summaries(gm, ctx, against=kept_plan))


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cycle collector off while planning: a plan allocates millions of small objects (fake tensors,
    graph nodes, candidates), and the full collections they set off walked the whole heap for about 1 s of
    Llama-3-8B's 7 s on (8, 8). The cycles planning leaves (a few hundred MB at most) are collected as usual once
    it is back on."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _solved(model: nn.Module, ctx: PassContext) -> tuple[fx.GraphModule, PassContext]:
    """The planning passes on ``model``: capture .. strategies once per recomputation tagging of a planning cache
    (``PlanningCache.prepared``), then the solve, on a copy of that graph and context for every later attempt
    alike (a recipe planned alone, the plan at a recipe's recomputation): they differ only in what the solve
    pins and compares, and the integer program itself (``ctx.problem``) is built once too."""
    cache = ctx.cache
    key = tuple(ctx.config.recompute)
    if cache is None or key not in cache.prepared:
        gm = run_passes(model, ctx, PLANNING[0], "strategies")
        if cache is not None:
            cache.prepared[key] = (copy_graph(gm), dataclasses.replace(ctx, stats=dict(ctx.stats), timings={}))
        gm = run_passes(gm, ctx, "solve", PLANNING[1])
        if cache is not None:
            cache.prepared[key][1].problem = ctx.problem
        return gm, ctx
    gm0, ctx0 = cache.prepared[key]
    ctx = dataclasses.replace(
        ctx0,
        config=ctx.config,
        broadcast_solution=ctx.broadcast_solution,
        progress=ctx.progress,
        timings={},
        stats=dict(ctx0.stats),
        solution=None,
        recipes=[],
    )
    return run_passes(copy_graph(gm0), ctx, "solve", PLANNING[1]), ctx


def prepare_once(
    model: nn.Module,
    example_inputs: Sequence[Any],
    mesh: DeviceMesh,
    cluster: ClusterProfile,
    config: PlanConfig,
    cache: PlanningCache,
    *,
    stage: bool = False,
) -> None:
    """The passes capture .. strategies and the integer program of ``config``'s recomputation tagging, kept in
    ``cache.prepared`` for the attempts that solve it (``_solved``) without solving it here: so that processes
    forked next (the recipes planned alone) find it built, as this process does."""
    if tuple(config.recompute) in cache.prepared:
        return
    ctx = PassContext(
        mesh=mesh, cluster=cluster, config=config, stage=stage, example_inputs=example_inputs, cache=cache
    )
    with _collector_paused():
        gm = run_passes(model, ctx, PLANNING[0], "strategies")
        kept = dataclasses.replace(ctx, stats=dict(ctx.stats), timings={})
        kept.problem = problem_of(gm, ctx)
        cache.prepared[tuple(config.recompute)] = (copy_graph(gm), kept)


def plan_once(
    model: nn.Module,
    example_inputs: Sequence[Any],
    mesh: DeviceMesh,
    cluster: ClusterProfile,
    config: PlanConfig,
    *,
    broadcast_solution: bool = False,
    progress: Any = None,
    stage: bool = False,
    cache: PlanningCache | None = None,
) -> Planned:
    """The planning passes once on ``model`` under ``config``; ``stage=True`` plans a pipeline stage (tensor
    outputs, input gradients; see capture)."""
    t0 = time.perf_counter()
    ctx = PassContext(
        mesh=mesh,
        cluster=cluster,
        config=config,
        broadcast_solution=broadcast_solution,
        progress=progress,
        stage=stage,
        example_inputs=example_inputs,
        cache=cache,
    )
    with _collector_paused():
        gm, ctx = _solved(model, ctx)
        ctx.cache = None  # (shared with the other attempts only while planning: a Planned does not hold it)
        plan = build_plan(gm, ctx, recipe=ctx.config.recipe or "")
        if ctx.recipes:
            plan = _keep_faster_recipe(
                dataclasses.replace(plan, recipes=recipe_summaries(gm, ctx, against=plan)), gm, ctx
            )
    ctx.timings["total"] = time.perf_counter() - t0
    log.info(
        "plan: predicted step %.6f s, %s", plan.step_time_s, ", ".join(f"{k} {v:.2f}s" for k, v in ctx.timings.items())
    )
    return Planned(plan, gm, ctx)


__all__ = ["Planned", "build_plan", "plan_once", "prepare_once", "recipe_summaries"]
