"""solve: choose one candidate per decision group (CP-SAT, see ``autoshard.solver.intra_op``) and write
the choice onto the nodes.

Needs: ``strategies`` (``ctx.strategies``) and ``share_layers`` (``ctx.layer_of_group``).

Guarantees on exit: ``ctx.solution`` is a ``Solution``; every placeholder and call node has
``meta["autoshard"]`` = ``NodeSharding`` (its group, output placements, required input placements), taken
from its group's chosen candidate. Same graph and options -> same plan.
"""

from __future__ import annotations

import logging

import torch.distributed as dist
import torch.fx as fx

from autoshard.ir import NodeSharding
from autoshard.passes.context import PassContext
from autoshard.solver.intra_op import IntraOpProblem

log = logging.getLogger(__name__)


def solve(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    canon = ctx.layer_of_group or {g.id: g.id for g in ctx.groups}
    if ctx.broadcast_solution and dist.get_rank() != 0:
        # rank 0 solves and sends its choice: every rank must run the same plan, whatever the time limit
        # (with the recipes it was compared against, so every rank's Plan reads the same)
        box: list = [None]
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], BaseException):
            raise RuntimeError(f"rank 0 could not plan: {box[0]}")
        ctx.solution, ctx.baselines = box[0]
        annotate(gm, ctx)
        return gm
    try:
        ctx.solution = _solve(gm, ctx, canon)
    except Exception as e:
        if ctx.broadcast_solution:
            dist.broadcast_object_list([e], src=0)
        raise
    if ctx.broadcast_solution:
        dist.broadcast_object_list([(ctx.solution, ctx.baselines)], src=0)
    annotate(gm, ctx)
    return gm


def _solve(gm: fx.GraphModule, ctx: PassContext, canon: dict[int, int]):
    ctx.problem = IntraOpProblem(
        gm, ctx.groups, ctx.strategies, canon, ctx.output_roles, ctx.mesh_shape, ctx.cluster, ctx.group_weight
    )
    from autoshard.baselines import best_baseline_hint, recipe_pins

    hint = pins = None
    if ctx.config.recipe is not None:
        pins, notes = recipe_pins(ctx.config.recipe, gm, ctx)
        for note in notes:
            log.warning("recipe %s: %s", ctx.config.recipe, note)
    elif ctx.config.warm_start:
        hint = best_baseline_hint(gm, ctx)
    return ctx.problem.solve(
        memory_budget=ctx.config.memory_budget,
        time_limit_s=ctx.config.time_limit_s,
        hint=hint,
        pins=pins,
        num_workers=ctx.config.num_workers,
        seed=ctx.config.seed,
        what=ctx.config.recipe or "plan",
    )


def annotate(gm: fx.GraphModule, ctx: PassContext, solution=None) -> None:
    """Write a solution's layouts onto the nodes (default: ``ctx.solution``)."""
    sol = solution if solution is not None else ctx.solution
    nodes = {n.name: n for n in gm.graph.nodes}
    for g in ctx.groups:
        s = ctx.strategies[g.id][sol.choice[g.id]]
        for i, name in enumerate(g.members):
            nodes[name].meta["autoshard"] = NodeSharding(g.id, s.outputs[i], s.inputs[i])
