"""Planning: the planning passes run (``autoshard/compiler/runner.py``), and the Plan value of their solved graph.

``plan_graph`` runs capture .. solve and builds the ``Plan`` (layouts, decisions, collectives, predicted time and
memory, the recipes' numbers); ``autoshard.compile`` then runs the program passes (lower .. compile) on the same
graph and context.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autoshard.cluster.profile import ClusterProfile
from autoshard.config import PlanConfig
from autoshard.cost.memory import temporaries, transients
from autoshard.notation import placements_tuple
from autoshard.compiler.context import PassContext
from autoshard.compiler.recompute import (FULL, SELECTIVE, best_mix, describe, layer_replays, mix_peak, mix_specs,
                                        replay_time, spec, typical_replay)
from autoshard.compiler.runner import PLANNING, run_passes
from autoshard.compiler.solve import annotate
from autoshard.compiler.solve_reuse import program_fingerprint
from autoshard.ir import repeated_layers
from autoshard.solver.intra_op import GRAD_SINK_CREDIT
from autoshard.errors import InfeasibleBudget
from autoshard.plans.collectives import plan_collectives, weight_of
from autoshard.plans.plan import (
    RecipeSummary,
    MemoryBreakdown,
    MeshSpec,
    OpDecision,
    Plan,
    SolverStats,
    StagePlan,
    TensorLayout,
)

log = logging.getLogger(__name__)


def _dtype(v: torch.Tensor) -> str:
    return str(v.dtype).replace("torch.", "")


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
        sh = n.meta["autoshard"]
        tensors.append(TensorLayout(role.name, role.kind, tuple(v.shape), _dtype(v), placements_tuple(sh.outputs[0]),
                                    placements_tuple(sh.grad) if sh.state is not None else (), placements_tuple(sh.state), sh.offload))
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
    comm = sum(c.time_s * c.repeat for c in collectives)
    # the solver's overlap credit (GRAD_SINK_CREDIT): part of each gradient reduction hides behind backward
    hidden = GRAD_SINK_CREDIT * sum(c.time_s * c.repeat for c in collectives if c.consumer in ctx.param_modules)
    factor = ctx.config.optimizer_factor
    t = transients(gm, ctx.mesh_shape, ctx.output_roles, weight=lambda n: weight_of(nodes, n.name, ctx))
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
        recompute_s=replay_time(gm, ctx.mesh_shape, ctx.cluster.device, ctx.group_weight) if ctx.config.recompute else 0.0,
        **ctx.config.precision_fields,
        fingerprint=program_fingerprint(gm, ctx),
    )


def recipe_summaries(gm: fx.GraphModule, ctx: PassContext) -> tuple[RecipeSummary, ...]:
    """Each recipe's Plan-level numbers (same accounting as the plan), computed from ``ctx.recipes``."""
    out = []
    for r in ctx.recipes:
        if r.solution is None:
            out.append(RecipeSummary(r.name, math.inf, 0, False, r.note))
            continue
        annotate(gm, ctx, r.solution)
        p = build_plan(gm, ctx, r.solution, recipe=r.name)
        out.append(RecipeSummary(r.name, p.step_time_s, p.peak_memory.total, r.fits, r.note))
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
    log.info("plan: the %s recipe's layouts step in %.6f s, the solved plan's in %.6f s; keeping the recipe's",
             best.name, best.step_time_s, plan.step_time_s)
    ctx.solution = dataclasses.replace(kept.solution, status=f"{ctx.solution.status}, {best.name} kept",
                                       bound_s=ctx.solution.bound_s)
    annotate(gm, ctx)
    return dataclasses.replace(build_plan(gm, ctx, recipe=""), recipes=plan.recipes)


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
    """Plan ``model``; ``stage=True`` plans a pipeline stage (tensor outputs, input gradients; see capture).

    Under a memory budget (and no ``config.recompute`` given) recomputation is weighed per layer
    (``autoshard/compiler/recompute.py``): the plans that save everything, recompute every repeated layer in full, and
    selectively (all but the matmuls); then, from the last two's layouts and their layers' replay costs
    (``layer_replays``), the mix of saved, selective and fully recomputed layers predicted to fit the budget
    fastest (``best_mix``) is planned when it is predicted ahead, and once more with the estimate corrected. The
    fastest that fits is kept: the budget may have forced the plan that saves everything into slower layouts, and
    recomputing only some layers, or only their cheap ops, may be enough. A plan that saves everything and peaks
    below ``SLACK`` of the budget is not bound by it and is kept without the others. The plan's recipes are each
    recipe's faster fitting form of saving everything and recomputing every layer."""
    layers = repeated_layers(model) if config.memory_budget is not None and not stage and not config.recompute else None
    once = functools.partial(_plan_once, model, example_inputs, mesh, cluster, broadcast_solution=broadcast_solution,
                             progress=progress, stage=stage)
    if layers is None or not layers[0]:
        return once(config)
    container, total = layers
    plans: list[tuple[Plan, fx.GraphModule, PassContext]] = []
    failed: list[InfeasibleBudget] = []

    def attempt(specs: tuple[str, ...]) -> tuple[Plan, fx.GraphModule, PassContext] | None:
        try:
            plans.append(once(dataclasses.replace(config, recompute=specs)))
            return plans[-1]
        except InfeasibleBudget as e:
            failed.append(e)
            return None

    saving = attempt(())
    if saving is not None and saving[0].peak_memory.total <= SLACK * config.memory_budget:
        # the budget does not bind the plan that saves everything: recomputing could only cost time (the recipes,
        # whose layouts the budget may bind, are solved recomputing every layer too: the forms people would run)
        full = attempt((container,)) if config.solve_recipes else None
        return dataclasses.replace(saving[0], recipes=_recipes_of([r for r in (saving, full) if r])), *saving[1:]
    full = attempt((container,))
    reps = {}
    if full is not None and (replays := layer_replays(full[1], full[2].mesh_shape, cluster.device, FULL)):
        reps[FULL] = typical_replay(replays.values())
    # the selective plan holds more than the full one and its layout is no faster: planned where the full plan's
    # step less the replays selective recomputation spares is ahead of the plans so far
    sel = None
    if FULL in reps and full[0].step_time_s - total * (reps[FULL].full_s - reps[FULL].cheap_s) < _fastest(plans):
        sel = attempt((spec(container, SELECTIVE),))
    if sel is not None and (replays := layer_replays(sel[1], sel[2].mesh_shape, cluster.device, SELECTIVE)):
        reps[SELECTIVE] = typical_replay(replays.values())
    pure = {(total, 0, 0), (0, total, 0), (0, 0, total)}
    options = []  # (predicted step, counts, anchor run, anchor counts, its typical layer)
    for run, mode, anchor in ((full, FULL, (0, 0, total)), (sel, SELECTIVE, (0, total, 0))):
        if mode in reps:
            rep = reps[mode]
            found = best_mix(total, rep, anchor, run[0].step_time_s, run[0].peak_memory.total,
                             0.98 * config.memory_budget, allow_full=mode == FULL)
            log.info("plan: a layer of %s in the %s plan's layout: full recomputation frees %.3g B for %.3g s, "
                     "selective %.3g B for %.3g s; fastest mix (saved, selective, full) %s", container, mode,
                     rep.full_bytes, rep.full_s, rep.cheap_bytes, rep.cheap_s, found)
            if found is not None and found[0] not in pure:
                options.append((found[1], found[0], run, anchor, rep, mode))
    ahead = [o for o in options if o[0] < _fastest(plans)]
    if ahead:  # the mix predicted fastest, if ahead; once more with the estimate corrected by what it missed
        _, counts, run, anchor, rep, mode = min(ahead, key=lambda o: o[0])
        tried = set(pure)
        while counts not in tried:
            tried.add(counts)
            got = attempt(mix_specs(container, counts))
            peak = got[0].peak_memory.total if got is not None else failed[-1].least_bytes
            if not peak:
                break
            offset = peak - mix_peak(rep, anchor, run[0].peak_memory.total, counts)
            found = best_mix(total, rep, anchor, run[0].step_time_s, run[0].peak_memory.total,
                             0.98 * config.memory_budget, offset, allow_full=mode == FULL)
            if found is None or len(tried) > len(pure) + 1:
                break
            counts = found[0]
    if not plans:
        raise min(failed, key=lambda e: e.least_bytes or math.inf)
    best = min(plans, key=lambda p: p[0].step_time_s)
    best = (dataclasses.replace(best[0], recipes=_recipes_of([r for r in (saving, full) if r is not None])), *best[1:])
    if best[0].recompute:
        log.info("plan: recomputing %s in the backward (%s)", describe(best[2].config.recompute),
                 ", ".join(f"{p[0].step_time_s:.6f} s with {describe(p[2].config.recompute) or 'every activation saved'}"
                           for p in plans))
    return best


def _fastest(plans: Sequence[tuple[Plan, fx.GraphModule, PassContext]]) -> float:
    return min((p[0].step_time_s for p in plans), default=math.inf)


SLACK = 0.9  # a plan whose peak is below this share of the budget is taken as not bound by it


def _recipes_of(runs: Sequence[tuple[Plan, fx.GraphModule, PassContext]]) -> tuple[RecipeSummary, ...]:
    """The recipes as people run them, each the faster that fits of saving every activation and recomputing every
    layer (the runs that planned those): the mixes the planner found are its own, not the recipes'."""
    best: dict[str, RecipeSummary] = {}
    for plan, _, ctx in runs:
        for r in plan.recipes:
            if ctx.config.recompute and r.applies:
                r = dataclasses.replace(r, note="; ".join(x for x in (r.note, "every layer recomputed") if x))
            cur = best.get(r.name)
            if cur is None or (r.fits, -r.step_time_s) > (cur.fits, -cur.step_time_s):
                best[r.name] = r
    return tuple(best.values())


def _plan_once(model: nn.Module, example_inputs: Sequence[Any], mesh: DeviceMesh, cluster: ClusterProfile,
               config: PlanConfig, *, broadcast_solution: bool, progress: Any, stage: bool
               ) -> tuple[Plan, fx.GraphModule, PassContext]:
    t0 = time.perf_counter()
    ctx = PassContext(mesh=mesh, cluster=cluster, config=config, broadcast_solution=broadcast_solution,
                      progress=progress, stage=stage, example_inputs=example_inputs)
    gm = run_passes(model, ctx, *PLANNING)
    plan = build_plan(gm, ctx, recipe=ctx.config.recipe or "")
    if ctx.recipes:
        plan = _keep_faster_recipe(dataclasses.replace(plan, recipes=recipe_summaries(gm, ctx)), gm, ctx)
    ctx.timings["total"] = time.perf_counter() - t0
    log.info("plan: predicted step %.6f s, %s", plan.step_time_s, ", ".join(f"{k} {v:.2f}s" for k, v in ctx.timings.items()))
    return plan, gm, ctx


__all__ = ["build_plan", "plan_graph"]
