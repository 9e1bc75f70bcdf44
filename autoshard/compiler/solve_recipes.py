"""The manual recipes solved on the plan's own integer program (part of ``solve``, not a pass of its own).

A recipe (``autoshard.solver.recipes``: ddp, fsdp, Megatron tp, fsdp+tp) says where every parameter and the batch
go; ``recipe_pins`` turns that into the candidates each decision group may keep (and, with data parallelism,
keeps every op on the batch on its batch shard), and ``solve_recipe`` solves ``ctx.problem`` with those pins.
A recipe is therefore the same program with fewer choices, costed by the same model as the plan: the best
program that recipe allows, not a straw man. Recipes keep the optimizer state on the device (the offloaded
candidates of ``parameter_forms.offload_variants`` are the plan's choice alone), except where ``PlanConfig.offload``
forces it to the host for every parameter: then a recipe pins its layouts' offloaded forms.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from autoshard.compiler.context import PassContext
from autoshard.compiler.solve_memory import solve_within
from autoshard.config import normalize
from autoshard.errors import InfeasibleBudget, InputError, SolverTimeout
from autoshard.ir import is_frozen, tensor_args, view_root
from autoshard.notation import placement_str
from autoshard.rules import attention
from autoshard.solver.recipes import (
    RecipeResult,
    applicable,
    candidate_state_kind,
    even_prefix,
    is_expert_weight,
    recipe_placements,
    state_kind,
)

T = TypeVar("T")

log = logging.getLogger(__name__)


def recipe_pins(
    recipe: str, gm: fx.GraphModule, ctx: PassContext, memo: dict[frozenset[int], dict[int, set[int]]] | None = None
) -> tuple[dict[int, set[int]], list[str]]:
    """Candidate subsets per canonical group that realise ``recipe``; raises ValueError when it cannot apply.
    ``memo``: the batch ops' pins by data-parallel axes, shared by the recipes of one plan (``_batch_pins``)."""
    recipe = normalize(recipe)
    canon = ctx.layer_of_group or {g.id: g.id for g in ctx.groups}
    nodes = {n.name: n for n in gm.graph.nodes}
    ms = ctx.mesh_shape
    if recipe == "cp" and not has_attention(gm):
        raise InputError(
            "recipe 'cp' shards the sequence of attention and this model has no attention op that "
            "autoshard can shard on the sequence (self-attention of at least 256 tokens); use fsdp or tp"
        )
    if recipe == "ep" and not has_experts(gm, ctx):
        raise InputError(
            "recipe 'ep' shards stacked expert weights ([experts, in, out] parameters of a mixture of "
            "experts) and this model has none; use fsdp, tp or fsdp+tp"
        )
    pins: dict[int, set[int]] = {}
    dp_axes: set[int] = set()
    bent = unmatched = kept_whole = 0
    forced = ctx.config.offload in ("optimizer", "params")
    for g in ctx.groups:
        if g.kind not in ("parameter", "input") or canon[g.id] != g.id:
            continue
        node = nodes[g.anchor]
        role = node.meta["autoshard_role"]
        val = node.meta["val"]
        shape = tuple(val.shape)
        target, note = recipe_placements(recipe, role.name, role.kind, ctx.param_modules.get(role.name, ""), shape, ms)
        unmatched += note == "unmatched"
        cands = ctx.strategies[g.id]
        layouts = [s.outputs[0][0] for s in cands]
        kinds = [candidate_state_kind(s.grad_placements, s.state_placements) for s in cands]
        whole = [
            s.state_placements is None or all(isinstance(p, Shard) or n == 1 for p, n in zip(s.state_placements, ms))
            for s in cands
        ]
        trained = role.kind == "parameter" and not is_frozen(node)  # (a frozen one has no state to shard or offload)
        want = state_kind(recipe) if trained else ""
        # a recipe keeps its state on the device, unless PlanConfig.offload forces every parameter's to the host:
        # then the recipe's layouts are pinned with their offloaded forms (ZeRO-Offload over ddp, fsdp, ...)
        offloaded = [bool(s.offload) for s in cands]
        host = forced and trained

        def matching(
            layout: tuple,
            kind: str,
            layouts: list = layouts,
            offloaded: list[bool] = offloaded,
            host: bool = host,
            kinds: list = kinds,
            whole: list[bool] = whole,
        ) -> set[int]:  # the state sharded over every axis it can be
            return {
                i
                for i, pl in enumerate(layouts)
                if tuple(pl) == layout and offloaded[i] == host and (host or (kinds[i] == kind and whole[i]))
            }

        keep = matching(target, want)
        if not keep and want:  # a parameter whose state cannot be sharded evenly stays whole, as ddp holds it
            keep = matching(target, "")
            kept_whole += bool(keep)
        if not keep and role.kind == "parameter":
            relaxed = even_prefix(target, shape, ms)
            keep = matching(relaxed, "")
            bent += bool(keep)
        if not keep and role.kind == "input" and _pinned_input(ctx, role.name):
            # the caller placed this input (compile without example inputs: each rank's rows): it stays as given and
            # moves to the recipe's layout where its first op reads it (the batch ops below keep the recipe's)
            keep = set(range(len(cands)))
        if not keep:
            names = ctx.mesh_names
            want = ", ".join(f"{a}: {placement_str(p)}" for a, p in zip(names, target))
            if role.kind == "input":
                dp = [n for n, p in zip(ms, target) if isinstance(p, Shard)]
                raise InputError(
                    f"recipe {recipe!r} shards {role.name} of shape {list(shape)} as {{{want}}}, but dim 0 "
                    f"({shape[0]}) is not divisible by the data-parallel degree "
                    f"{int(torch.tensor(dp).prod()) if dp else 1} of mesh "
                    f"{dict(zip(names, ms))} (or a constraint forbids it); use a global batch that is a multiple of it"
                )
            raise InputError(
                f"recipe {recipe!r} needs {role.name} {list(shape)} placed {{{want}}}, which its candidates do not "
                f"include ("
                + (
                    "offload='params' keeps only layouts sharded over every axis; "
                    if ctx.config.offload == "params"
                    else ""
                )
                + "a constraint in PlanConfig.constraints may "
                "forbid it)"
            )
        pins[g.id] = keep
        if role.kind == "input":  # the batch's axes (a sequence shard, cp's, leaves the ops on it free)
            dp_axes.update(a for a, p in enumerate(target) if isinstance(p, Shard) and p.dim == 0)
    if recipe == "ep":
        pins.update(_expert_op_pins(gm, ctx, canon, pins))
    if dp_axes:
        axes = frozenset(dp_axes)
        memo = memo if memo is not None else {}
        if axes not in memo:
            memo[axes] = _batch_pins(gm, ctx, canon, axes)
        for c, keep in memo[axes].items():  # (an expert op keeps what both leave it, if anything)
            pins[c] = (pins[c] & keep) or pins[c] if c in pins else keep
    notes = []
    if unmatched:
        notes.append(f"{unmatched} Linear weights not recognised as column/row-parallel stay replicated on tp")
    if bent:
        notes.append(f"{bent} parameters replicated where the shard would be uneven")
    if kept_whole:
        notes.append(f"{kept_whole} parameters keep whole optimizer state (no even shard)")
    return pins, notes


def _pinned_input(ctx: PassContext, name: str) -> bool:
    """Whether a constraint places input ``name`` (``input[i]``), by its place or by its argument's name."""
    i = int(name[len("input[") : -1])
    names = ctx.signature.names if ctx.signature is not None else ()
    alias = names[i] if i < len(names) else ""
    return ctx.config.constraint_for(name, "input", ctx.mesh_names, alias) is not None


def has_experts(gm: fx.GraphModule, ctx: PassContext) -> bool:
    """Whether the model has stacked expert weights (``autoshard.solver.recipes.is_expert_weight``)."""
    for n in gm.graph.nodes:
        role = n.meta.get("autoshard_role")
        if (
            n.op == "placeholder"
            and role is not None
            and role.kind == "parameter"
            and is_expert_weight(ctx.param_modules.get(role.name, ""), tuple(n.meta["val"].shape))
        ):
            return True
    return False


def has_attention(gm: fx.GraphModule) -> bool:
    """Whether the graph has an attention op that may shard its sequence (``autoshard/rules/attention.py``)."""
    ops = attention.RULE.ops()
    return any(
        n.op == "call_function" and str(n.target) in ops and attention.splits_sequence(n) for n in gm.graph.nodes
    )


def _expert_op_pins(
    gm: fx.GraphModule, ctx: PassContext, canon: dict[int, int], pinned: dict[int, set[int]]
) -> dict[int, set[int]]:
    """Expert parallelism moves the tokens to their experts, not the experts to the tokens: an op that reads an
    expert weight (or a view of one) takes it sharded on every mesh axis the recipe shards it on (no op gathers
    an expert's weights, which is FSDP over the experts). Ops left with no such candidate keep all of theirs."""
    nodes = {n.name: n for n in gm.graph.nodes}
    by_name = {g.anchor: g for g in ctx.groups}
    sharded: dict[str, tuple[int, ...]] = {}  # expert weight placeholder -> the axes its pinned layouts shard
    for name, g in by_name.items():
        node = nodes[name]
        if g.kind != "parameter" or canon[g.id] not in pinned:
            continue
        role = node.meta["autoshard_role"]
        if is_expert_weight(ctx.param_modules.get(role.name, ""), tuple(node.meta["val"].shape)):
            cands = ctx.strategies[canon[g.id]]
            axes = [
                tuple(a for a, p in enumerate(cands[i].outputs[0][0]) if isinstance(p, Shard))
                for i in pinned[canon[g.id]]
            ]
            sharded[name] = tuple(sorted(set.intersection(*(set(a) for a in axes)))) if axes else ()
    pins: dict[int, set[int]] = {}
    for g in ctx.groups:
        if g.kind != "op" or canon[g.id] != g.id:
            continue
        reads = [
            (m, k, sharded[view_root(a).name])
            for m, name in enumerate(g.members)
            for k, a in enumerate(tensor_args(nodes[name]))
            if sharded.get(view_root(a).name)
        ]
        if not reads:
            continue
        cands = ctx.strategies[g.id]
        keep = {
            i
            for i, s in enumerate(cands)
            if all(
                s.inputs[m][k] is not None and all(isinstance(s.inputs[m][k][a], Shard) for a in axes)
                for m, k, axes in reads
            )
        }
        if keep and len(keep) < len(cands):
            pins[g.id] = keep
    return pins


def _batch_pins(
    gm: fx.GraphModule, ctx: PassContext, canon: dict[int, int], dp_axes: frozenset[int]
) -> dict[int, set[int]]:
    """Data parallelism: every op on the batch (downstream of an input) runs on its batch shard. On the
    data-parallel axes such an op neither takes a batch-derived input whole (Replicate: an activation gather
    and the op computed whole on every rank, which the hand-written recipe never does) nor makes a Replicate
    output where its candidates could split it. Ops left with no such candidate keep all of theirs."""
    batch: set[str] = set()
    for n in gm.graph.nodes:
        role = n.meta.get("autoshard_role")
        if (n.op == "placeholder" and role is not None and role.kind == "input") or any(
            a.name in batch for a in n.all_input_nodes
        ):
            batch.add(n.name)
    nodes = {n.name: n for n in gm.graph.nodes}
    whole = lambda pl: pl is not None and any(isinstance(pl[a], Replicate) for a in dp_axes)  # noqa: E731
    pins: dict[int, set[int]] = {}
    for g in ctx.groups:
        if g.kind != "op" or canon[g.id] != g.id or g.anchor not in batch:
            continue
        anchor = nodes[g.anchor]
        on_batch = [k for k, a in enumerate(tensor_args(anchor)) if a.name in batch]
        cands = ctx.strategies[g.id]
        outs = [s.outputs[0][0] if s.outputs and s.outputs[0] else None for s in cands]
        splittable = any(pl is not None and any(isinstance(pl[a], Shard) for a in dp_axes) for pl in outs)
        keep = set()
        for i, s in enumerate(cands):
            ins = s.inputs[0] if s.inputs else ()
            if splittable and (outs[i] is None or whole(outs[i])):
                continue
            if any(k < len(ins) and whole(ins[k]) for k in on_batch):
                continue
            keep.add(i)
        if keep and len(keep) < len(cands):
            pins[g.id] = keep
    return pins


def solve_recipe(
    recipe: str,
    gm: fx.GraphModule,
    ctx: PassContext,
    time_limit_s: float | None = None,
    pinned: tuple[dict[int, set[int]], list[str]] | None = None,
    within: dict[int, frozenset[int]] | None = None,
) -> RecipeResult:
    """Solve ``ctx.problem`` with the recipe's layouts pinned; over the budget it is solved without one and
    marked as not fitting (OOM), so its time is still known. ``pinned``: ``recipe_pins``' answer, when known;
    ``within``: the model it shares with other recipes (``shared_models``)."""
    recipe = normalize(recipe)
    try:
        pins, notes = pinned if pinned is not None else recipe_pins(recipe, gm, ctx)
    except ValueError as e:
        return RecipeResult(recipe, None, False, float("inf"), f"n/a: {e}")
    limit = float(time_limit_s if time_limit_s is not None else min(ctx.config.time_limit_s, 10.0))
    budget = ctx.config.memory_budget
    kw = dict(
        time_limit_s=limit,
        pins=pins,
        num_workers=ctx.config.num_workers,
        seed=ctx.config.seed,
        what=recipe,
        within=within,
    )
    fits = True
    outcomes = ctx.cache.recipe_outcomes if ctx.cache is not None else None  # (the same pins, budget and program)
    key = (tuple(ctx.config.recompute), recipe)
    try:
        sol = solve_within(gm, ctx, budget, **kw)
        if outcomes is not None:
            outcomes[key] = sol
    except (InfeasibleBudget, SolverTimeout) as e:
        fits = False
        if outcomes is not None and isinstance(e, InfeasibleBudget):
            outcomes[key] = e
        if isinstance(e, SolverTimeout):
            notes.append(f"no plan under the budget found within {limit:g} s (may fit with a longer time_limit_s)")
        try:
            sol = ctx.problem.solve(memory_budget=None, **kw)
        except (ValueError, SolverTimeout) as e2:
            return RecipeResult(recipe, None, False, float("inf"), f"n/a: {e2}")
    except ValueError as e:
        return RecipeResult(recipe, None, False, float("inf"), f"n/a: {e}")
    choice = {c: sol.choice[c] for c in ctx.problem.canon_ids}
    return RecipeResult(recipe, sol, fits, ctx.problem.evaluate(choice), "; ".join(notes))


def shared_models(
    pinned: dict[str, tuple[dict[int, set[int]], list[str]]], ctx: PassContext
) -> dict[str, dict[int, frozenset[int]]]:
    """Recipes that pin the ops alike (data parallelism's batch shards: ddp, zero1, zero2, fsdp, hsdp; or no op at
    all: tp, fsdp+tp) and differ only in their parameters' layouts solve copies of one model over the union of their
    candidates, built once: a third to a half of the model over every candidate, which is what a solve's time
    follows (the plan's model is built anyway; Mixtral-8x7B on (8, 8): 0.28 -> 0.10 s a recipe). By recipe, the
    candidates of each group every member pins (recipes alone in their kind share nothing)."""
    kinds = {g.id: g.kind for g in ctx.groups}
    kin: dict[frozenset, list[str]] = {}
    for name, (pins, _) in pinned.items():
        kin.setdefault(frozenset((c, frozenset(k)) for c, k in pins.items() if kinds.get(c) == "op"), []).append(name)
    # a recipe alone in its kind that pins the same ops to subsets of a kind's (ep: the batch ops, and the expert
    # ops to their shard) solves in that kind's model too
    for ops, members in list(kin.items()):
        if len(members) != 1:
            continue
        own = dict(ops)
        for other, group in kin.items():
            theirs = dict(other)
            if len(group) > 1 and own.keys() == theirs.keys() and all(own[c] <= theirs[c] for c in own):
                group.append(members[0])
                del kin[ops]
                break
    out: dict[str, dict[int, frozenset[int]]] = {}
    for members in kin.values():
        if len(members) < 2:
            continue
        groups = set.intersection(*(set(pinned[r][0]) for r in members))
        union = {c: frozenset().union(*(pinned[r][0][c] for r in members)) for c in sorted(groups)}
        out.update((r, union) for r in members)
    return out


def recipe_model(recipe: str, gm: fx.GraphModule, ctx: PassContext) -> dict[int, frozenset[int]] | None:
    """The model ``recipe`` is solved in alongside a plan (``shared_models``: the candidates its kind pins, or None,
    every candidate), so that the recipe planned alone solves the same program in the same model as its solves
    alongside, which its searches alone reuse (``PlanningCache.recipe_outcomes``), and in a smaller one."""
    recipes = applicable(ctx.mesh_shape, experts=has_experts(gm, ctx), attention=has_attention(gm))
    return shared_models(_pins(recipes, gm, ctx), ctx).get(normalize(recipe))


def _pins(recipes: Sequence[str], gm: fx.GraphModule, ctx: PassContext) -> dict:
    """Each recipe's pinned candidates (``recipe_pins``); a recipe that cannot pin is left out (``solve_recipe``
    says why)."""
    pinned = {}
    memo: dict[frozenset[int], dict[int, set[int]]] = {}
    for r in recipes:
        try:
            pinned[r] = recipe_pins(r, gm, ctx, memo)
        except ValueError:
            pass
    return pinned


def solve_recipes(
    gm: fx.GraphModule, ctx: PassContext, alongside: Callable[[], T] | None = None
) -> tuple[list[RecipeResult], T | None]:
    """Every recipe that applies to this mesh, solved (kept on ``ctx.recipes``), and ``alongside`` (the
    plan's own solve) run first on the same pool: CP-SAT releases the GIL while it searches, so a 2-core
    laptop solves two programs at a time."""
    recipes = applicable(ctx.mesh_shape, experts=has_experts(gm, ctx), attention=has_attention(gm))
    ctx.report("solve", 0.0, f"autoshard plan and recipes {', '.join(recipes)}")
    pinned = _pins(recipes, gm, ctx)
    within = shared_models(pinned, ctx)
    pool = ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1)))
    done = False
    try:
        own = pool.submit(alongside) if alongside is not None else None
        futures = [pool.submit(solve_recipe, r, gm, ctx, None, pinned.get(r), within.get(r)) for r in recipes]
        own_result = own.result() if own is not None else None
        results = [f.result() for f in futures]
        done = True
    finally:
        # a plan that cannot be made (a budget nothing meets) ends the pass at once: the recipes not started are
        # dropped rather than solved for a comparison no one will read (the recomputation search's first attempt)
        pool.shutdown(wait=done, cancel_futures=True)
    ctx.recipes = results
    for r in results:
        log.info(
            "recipe %-8s %s",
            r.name,
            f"{r.objective_s:.6f} s" + ("" if r.fits else " (over budget)") if r.solution else r.note,
        )
    return results, own_result


def best_recipe(ctx: PassContext) -> RecipeResult | None:
    """The fastest recipe that fits the budget (None when none does)."""
    feasible = [r for r in ctx.recipes if r.solution is not None and r.fits]
    return min(feasible, key=lambda r: r.objective_s) if feasible else None
