"""solve: choose one candidate per decision group (CP-SAT, see ``autoshard.solver.intra_op``) and write
the choice onto the nodes.

Needs: ``strategies`` (``ctx.strategies``) and ``share_layers`` (``ctx.layer_of_group``).

Guarantees on exit: ``ctx.solution`` is a ``Solution``; every placeholder and call node has
``meta["autoshard"]`` = ``NodeSharding`` (its group, output placements, required input placements), taken
from its group's chosen candidate. Same graph and options -> same plan.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch.distributed as dist
import torch.fx as fx

from autoshard.compiler.context import PassContext
from autoshard.compiler.solve_memory import layouts_of, solve_within, step_floor
from autoshard.compiler.solve_recipes import best_recipe, recipe_model, recipe_pins, solve_recipes
from autoshard.compiler.solve_reuse import program_fingerprint, reused_solution
from autoshard.config import normalize
from autoshard.errors import InfeasibleBudget, InputError, RankFailed
from autoshard.messages import warn
from autoshard.rules import random_draws
from autoshard.solver.intra_op import IntraOpProblem, Solution

log = logging.getLogger(__name__)


def same_program(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Every rank traced the program rank 0 did (its choices are about to be applied to each rank's own trace):
    the fingerprints are gathered and compared, and a difference raises on every rank, naming the ranks, the
    parts and the first op that differ."""
    prints: list = [None] * dist.get_world_size()
    dist.all_gather_object(prints, tuple(program_fingerprint(gm, ctx)))  # a few short strings per rank
    bad = [r for r, other in enumerate(prints) if other != prints[0]]
    if not bad:
        return
    # every rank saw the difference: only now are the op lists gathered, to name the first that differs
    everyone: list = [None] * len(prints)
    dist.all_gather_object(
        everyone, [f"{n.name} = {n.target}{_shape(n)}" for n in gm.graph.nodes if n.op == "call_function"]
    )
    r, ref, other = bad[0], everyone[0], everyone[bad[0]]
    theirs = dict(prints[r])
    parts = "; ".join(f"{k}: rank 0 {v!r}, rank {r} {theirs.get(k)!r}" for k, v in prints[0] if theirs.get(k) != v)
    first = next((i for i, (a, b) in enumerate(zip(ref, other)) if a != b), min(len(ref), len(other)))
    ops0 = ref[first] if first < len(ref) else "(none: its program ends)"
    ops1 = other[first] if first < len(other) else "(none: its program ends)"
    raise InputError(
        f"the ranks traced different programs: rank(s) {bad} differ from rank 0 ({parts}); the first op that "
        f"differs, #{first}: rank 0 `{ops0}`, rank {r} `{ops1}`. Every rank must call the same model code on "
        "inputs of the same shapes and dtypes (a forward that branches on the rank, or another batch size on one "
        "rank, cannot be sharded)"
    )


def _shape(node: fx.Node) -> str:
    v = node.meta.get("val")
    return f" {list(v.shape)}" if hasattr(v, "shape") else ""


def solve(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    canon = ctx.layer_of_group or {g.id: g.id for g in ctx.groups}
    if ctx.broadcast_solution and dist.get_world_size() > 1:
        same_program(gm, ctx)
    if ctx.broadcast_solution and dist.get_rank() != 0:
        # rank 0 solves and sends its choice: every rank must run the same plan, whatever the time limit
        # (with the recipes it was compared against, so every rank's Plan reads the same)
        box: list = [None]
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], InfeasibleBudget):  # the same verdict on every rank (the planner acts on it)
            raise box[0]
        if isinstance(box[0], BaseException):
            raise RankFailed(f"rank 0 could not plan: {box[0]}")
        ctx.solution, ctx.recipes = box[0]
        annotate(gm, ctx)
        return gm
    try:
        ctx.solution = _solve(gm, ctx, canon)
    except Exception as e:
        if ctx.broadcast_solution:
            dist.broadcast_object_list([e], src=0)
        raise
    if ctx.broadcast_solution:
        dist.broadcast_object_list([(ctx.solution, ctx.recipes)], src=0)
    annotate(gm, ctx)
    return gm


def problem_of(gm: fx.GraphModule, ctx: PassContext) -> IntraOpProblem:
    """The integer program of the graph after ``strategies`` (built once per graph and context, then solved under
    each side condition)."""
    canon = ctx.layer_of_group or {g.id: g.id for g in ctx.groups}
    return IntraOpProblem(
        gm,
        ctx.groups,
        ctx.strategies,
        canon,
        ctx.output_roles,
        ctx.mesh_shape,
        ctx.cluster,
        ctx.group_weight,
        grad_itemsize=ctx.config.reduce_itemsize,
    )


def _solve(gm: fx.GraphModule, ctx: PassContext, canon: dict[int, int]):
    t0 = time.perf_counter()
    if ctx.problem is None:  # (a planning attempt on a copy of an earlier one's context has it: search/planned.py)
        ctx.problem = problem_of(gm, ctx)
    _add_time(ctx, "problem", t0)
    if ctx.config.reuse is not None:  # compile(..., plan=saved): its choices, checked against this program
        return reused_solution(gm, ctx, ctx.config.reuse)
    pins = within = None
    if ctx.config.recipe is not None:
        pins, notes = recipe_pins(ctx.config.recipe, gm, ctx)
        within = recipe_model(ctx.config.recipe, gm, ctx)
        for note in notes:  # (a recipe priced for a plan's comparison has them in its row: search/recipes_alone.py)
            if ctx.config.solve_recipes:
                warn(log, "recipe %s: %s", ctx.config.recipe, note)
            else:
                log.info("recipe %s: %s", ctx.config.recipe, note)

    def own() -> Solution:
        t1 = time.perf_counter()
        try:
            return _own()
        finally:
            _add_time(ctx, "plan", t1)

    def _own() -> Solution:
        try:
            return _within()
        except InfeasibleBudget as e:
            raise _floored(e, ctx, pins) from None

    def _within() -> Solution:
        return solve_within(
            gm,
            ctx,
            ctx.config.memory_budget,
            time_limit_s=ctx.config.time_limit_s,
            pins=pins,
            num_workers=ctx.config.num_workers,
            seed=ctx.config.seed,
            what=ctx.config.recipe or "plan",
            within=within,
        )

    if ctx.config.recipe is not None and ctx.cache is not None:
        # solved alongside an earlier attempt on this program (search/recipes_alone.py plans recipes alone)
        known = ctx.cache.recipe_outcomes.get((tuple(ctx.config.recompute), normalize(ctx.config.recipe)))
        if isinstance(known, InfeasibleBudget):
            raise _floored(known, ctx, pins)
        if known is not None:
            return known
    if ctx.config.recipe is not None or not ctx.config.solve_recipes:
        return own()
    # the plan is solved alongside the manual recipes; a recipe is the same program with layouts pinned, so an
    # optimal plan is never slower than any of them; one cut short by the time limit, or stopped within the
    # solver's relative gap (intra_op.RELATIVE_GAP) of its bound, is replaced by the fastest recipe that fits
    # if that is faster
    t1 = time.perf_counter()
    _, sol = solve_recipes(gm, ctx, alongside=own)
    _add_time(ctx, "with_recipes", t1)
    best = best_recipe(ctx)
    if best is not None and best.objective_s < sol.objective_s * (1 - 1e-12):
        log.info(
            "solve: the %s recipe (%.6f s) beats the searched plan (%.6f s, %s); keeping it",
            best.name,
            best.objective_s,
            sol.objective_s,
            sol.status,
        )
        sol = dataclasses.replace(
            best.solution, status=f"{sol.status}, {best.name} kept", bound_s=sol.bound_s, variables=sol.variables
        )  # (the program searched: a recipe may solve a smaller one)
    return sol


def _floored(e: InfeasibleBudget, ctx: PassContext, pins: dict[int, set[int]] | None) -> InfeasibleBudget:
    """``e`` with the program's ``step_floor`` (what no micro-batch count brings the peak below: the gradient
    accumulation search skips the counts it rules out)."""
    if e.step_floor is None:
        e.step_floor = step_floor(ctx, pins)
    return e


def _add_time(ctx: PassContext, name: str, since: float) -> None:
    """The solve pass's parts in ``ctx.stats["solve_parts"]`` (``benchmarks/plan_time.py --profile`` prints them):
    the problem's build, the plan's own solve, and the plan with the recipes solved alongside it (two at a time).
    (``ctx.timings`` holds one entry per pass.)"""
    parts = ctx.stats.setdefault("solve_parts", {})
    parts[name] = parts.get(name, 0.0) + time.perf_counter() - since


def annotate(gm: fx.GraphModule, ctx: PassContext, solution=None) -> None:
    """Write a solution's layouts onto the nodes (default: ``ctx.solution``)."""
    sol = solution if solution is not None else ctx.solution
    nodes = {n.name: n for n in gm.graph.nodes}
    for name, sh in layouts_of(ctx, sol).items():
        nodes[name].meta["autoshard"] = sh
    random_draws.place_as_read(gm, ctx.config.random)  # (each rank draws its piece: what the backward saves)
