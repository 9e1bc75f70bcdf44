"""The hand-made recipes (DDP, FSDP, Megatron TP, FSDP + TP) as plans in the solver's own machinery.

A recipe fixes what an engineer fixes by hand: the placement of every parameter and of the batch. Everything
else (the layout of each activation, where the collectives go) is then chosen by the same integer program with
those placements pinned, so a baseline is costed by exactly the model that costs autoshard's plan, and is the
*best* program that recipe allows in that model — an honest bar: the solved plan must beat the recipe done
well, not a straw man. For Megatron TP that freedom is what turns the row-parallel output's all-reduce into
Megatron's sequence-parallel reduce-scatter + all-gather when that is cheaper.

=========  ==========================================================================================
recipe     parameters (mesh axes: ``dp`` = every axis but the last, ``tp`` = the last; 1-D: the one axis)
=========  ==========================================================================================
ddp        Replicate everywhere; the batch is Shard(0) over every axis
fsdp       Shard(0) over every axis (ZeRO-3: FSDP2's ``fully_shard`` on the flattened mesh); batch as DDP
tp         Megatron inside the last axis: column-parallel Linear weights Shard(0) (its bias Shard(0)),
           row-parallel Shard(1), the token embedding and LM head vocab-parallel Shard(0), the rest
           Replicate; Replicate on ``dp``, where the batch is Shard(0) (Megatron TP + SP x DP)
fsdp+tp    tp's layouts on ``tp``, plus Shard(0) of every parameter on ``dp`` (torchtitan's 2-D recipe)
=========  ==========================================================================================

Column/row roles come from module names, as in torchtitan's and Megatron's plans (q/k/v, gate/up, fc1 ...
are column-parallel; o/out/down/fc2/w2 ... row-parallel); a Linear the names do not cover stays replicated on
``tp`` and is counted in the baseline's note. A layout the mesh cannot hold evenly (e.g. a bias of odd length)
falls back to Replicate on that axis, also noted.
"""

from __future__ import annotations

import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autoshard.config import ALIASES, RECIPES, normalize
from autoshard.passes.context import PassContext
from autoshard.solver.intra_op import InfeasibleBudget, Solution, SolverTimeout

T = TypeVar("T")

log = logging.getLogger(__name__)


_COLUMN = re.compile(
    r"(^|\.)(wq|wk|wv|wqkv|qkv|q_proj|k_proj|v_proj|query|key|value|c_attn|in_proj|w1|w3|fc1|c_fc|gate_proj|up_proj|"
    r"gate_up_proj|fc_in|intermediate\.dense|lm_head|output|head)(\.weight|\.bias|)$"
)
_ROW = re.compile(r"(^|\.)(wo|o_proj|out_proj|c_proj|w2|fc2|down_proj|fc_out|output\.dense|proj)(\.weight|)$")
_TRANSPOSED = ("Conv1D",)  # Hugging Face GPT-2 stores Linear weights as [in, out]


@dataclass(frozen=True)
class BaselineResult:
    """How one recipe fared on this graph: its solution (None when it does not apply) and why."""

    name: str
    solution: Solution | None
    fits: bool
    objective_s: float
    memory_bytes: int
    note: str


def applicable(mesh_shape: Sequence[int]) -> tuple[str, ...]:
    """Recipes that mean something on this mesh (2-D recipes need two axes; TP needs a tp axis > 1)."""
    out = ["ddp", "fsdp"]
    if mesh_shape[-1] > 1:
        out.append("tp")
        if len(mesh_shape) >= 2 and any(n > 1 for n in mesh_shape[:-1]):
            out.append("fsdp+tp")
    return tuple(out)


def tp_role(name: str, module_type: str, shape: Sequence[int]) -> tuple[str, int | None]:
    """(role, tensor dim to shard on tp) of one parameter under Megatron TP."""
    nd = len(shape)
    transposed = module_type in _TRANSPOSED
    if module_type == "Embedding" and nd == 2:
        return "vocab", 0
    if _COLUMN.search(name) and (nd >= 2 or name.endswith(".bias")):
        if nd == 1:
            return "column-bias", 0
        # [out, in] (or [experts, in, out] for stacked experts, [in, out] for Conv1D): shard the output features
        return "column", (nd - 1 if transposed or nd == 3 else 0)
    if _ROW.search(name) and nd >= 2:
        return "row", (nd - 2 if transposed or nd == 3 else 1)
    if nd >= 2 and module_type in ("Linear", "Conv1D"):
        return "unmatched", None
    return "replicated", None


def recipe_placements(
    recipe: str, name: str, role: str, module_type: str, shape: Sequence[int], mesh_shape: Sequence[int]
) -> tuple[tuple[Placement, ...], str | None]:
    """Target placements of one graph input under ``recipe``, and a note when the recipe had to bend."""
    nd = len(mesh_shape)
    rep = [Replicate() for _ in range(nd)]
    note = None
    if role == "input":
        if not shape:
            return tuple(rep), None
        dp_axes = range(nd) if recipe in ("ddp", "fsdp") else range(nd - 1)
        return tuple(Shard(0) if i in dp_axes else Replicate() for i in range(nd)), None
    if role != "parameter" or not shape:
        return tuple(rep), None
    want = list(rep)
    if recipe in ("tp", "fsdp+tp"):
        kind, dim = tp_role(name, module_type, shape)
        if dim is not None:
            want[nd - 1] = Shard(dim)
        elif kind == "unmatched":
            note = "unmatched"
    if recipe == "fsdp":
        want = [Shard(0) for _ in range(nd)]
    elif recipe == "fsdp+tp":
        for i in range(nd - 1):
            want[i] = Shard(0)
    return tuple(want), note


def _even_prefix(target: tuple[Placement, ...], shape: Sequence[int], mesh_shape: Sequence[int]) -> tuple[Placement, ...]:
    """``target`` with every Shard the tensor cannot hold evenly turned to Replicate (tp axis kept first)."""
    sizes = list(shape)
    out = list(target)
    for axis in sorted(range(len(out)), key=lambda a: -a):
        p = out[axis]
        if isinstance(p, Shard):
            if p.dim < len(sizes) and sizes[p.dim] % mesh_shape[axis] == 0:
                sizes[p.dim] //= mesh_shape[axis]
            else:
                out[axis] = Replicate()
    return tuple(out)


def recipe_pins(recipe: str, gm: fx.GraphModule, ctx: PassContext) -> tuple[dict[int, set[int]], list[str]]:
    """Candidate subsets per canonical group that realise ``recipe``; raises ValueError when it cannot apply."""
    recipe = normalize(recipe)
    canon = ctx.layer_of_group or {g.id: g.id for g in ctx.groups}
    nodes = {n.name: n for n in gm.graph.nodes}
    ms = ctx.mesh_shape
    pins: dict[int, set[int]] = {}
    dp_axes: set[int] = set()
    bent = unmatched = 0
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
        keep = {i for i, pl in enumerate(layouts) if tuple(pl) == target}
        if not keep and role.kind == "parameter":
            relaxed = _even_prefix(target, shape, ms)
            keep = {i for i, pl in enumerate(layouts) if tuple(pl) == relaxed}
            bent += bool(keep)
        if not keep:
            names = ctx.mesh_names
            want = ", ".join(f"{a}: {_fmt(p)}" for a, p in zip(names, target))
            if role.kind == "input":
                dp = [n for n, p in zip(ms, target) if isinstance(p, Shard)]
                raise ValueError(
                    f"recipe {recipe!r} shards {role.name} of shape {list(shape)} as {{{want}}}, but dim 0 ({shape[0]}) "
                    f"is not divisible by the data-parallel degree {int(torch.tensor(dp).prod()) if dp else 1} of mesh "
                    f"{dict(zip(names, ms))} (or a constraint forbids it); use a global batch that is a multiple of it"
                )
            raise ValueError(
                f"recipe {recipe!r} needs {role.name} {list(shape)} placed {{{want}}}, which its candidates do not "
                f"include (a constraint in PlanConfig.constraints may forbid it)"
            )
        pins[g.id] = keep
        if role.kind == "input":
            dp_axes.update(a for a, p in enumerate(target) if isinstance(p, Shard))
    if dp_axes:
        pins.update(_batch_pins(gm, ctx, canon, dp_axes, pins))
    notes = []
    if unmatched:
        notes.append(f"{unmatched} Linear weights not recognised as column/row-parallel stay replicated on tp")
    if bent:
        notes.append(f"{bent} parameters replicated where the shard would be uneven")
    return pins, notes


def _batch_pins(gm: fx.GraphModule, ctx: PassContext, canon: dict[int, int], dp_axes: set[int],
                pinned: dict[int, set[int]]) -> dict[int, set[int]]:
    """Data parallelism: every op on the batch (downstream of an input) runs on its batch shard. On the
    data-parallel axes such an op neither takes a batch-derived input whole (Replicate: an activation gather
    and the op computed whole on every rank, which the hand-written recipe never does) nor makes a Replicate
    output where its candidates could split it. Ops left with no such candidate keep all of theirs."""
    from autoshard.ir import tensor_args

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
        if g.kind != "op" or canon[g.id] != g.id or g.id in pinned or g.anchor not in batch:
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


def _fmt(p: Placement) -> str:
    return f"S({p.dim})" if isinstance(p, Shard) else "R" if isinstance(p, Replicate) else str(p)


def solve_recipe(recipe: str, gm: fx.GraphModule, ctx: PassContext, time_limit_s: float | None = None) -> BaselineResult:
    """Solve ``ctx.problem`` with the recipe's layouts pinned; over the budget it is solved without one and
    marked as not fitting (OOM), so its time is still known."""
    recipe = normalize(recipe)
    try:
        pins, notes = recipe_pins(recipe, gm, ctx)
    except ValueError as e:
        return BaselineResult(recipe, None, False, float("inf"), 0, f"n/a: {e}")
    limit = float(time_limit_s if time_limit_s is not None else min(ctx.config.time_limit_s, 10.0))
    budget = ctx.config.memory_budget
    kw = dict(time_limit_s=limit, pins=pins, num_workers=ctx.config.num_workers, seed=ctx.config.seed, what=recipe)
    fits = True
    try:
        sol = ctx.problem.solve(memory_budget=budget, **kw)
    except (InfeasibleBudget, SolverTimeout) as e:
        fits = False
        if isinstance(e, SolverTimeout):
            notes.append(f"no plan under the budget found within {limit:g} s (may fit with a longer time_limit_s)")
        try:
            sol = ctx.problem.solve(memory_budget=None, **kw)
        except (ValueError, SolverTimeout) as e2:
            return BaselineResult(recipe, None, False, float("inf"), 0, f"n/a: {e2}")
    except ValueError as e:
        return BaselineResult(recipe, None, False, float("inf"), 0, f"n/a: {e}")
    choice = {c: sol.choice[c] for c in ctx.problem.canon_ids}
    return BaselineResult(recipe, sol, fits, ctx.problem.evaluate(choice), sol.memory_bytes, "; ".join(notes))


def run_baselines(gm: fx.GraphModule, ctx: PassContext, alongside: Callable[[], T] | None = None) -> tuple[list[BaselineResult], T | None]:
    """Every recipe that applies to this mesh, solved (kept on ``ctx.baselines``), and ``alongside`` (the
    plan's own solve) run first on the same pool: CP-SAT releases the GIL while it searches, so a 2-core
    laptop solves two programs at a time."""
    recipes = applicable(ctx.mesh_shape)
    ctx.report("solve", 0.0, f"autoshard plan and baselines {', '.join(recipes)}")
    with ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1))) as pool:
        own = pool.submit(alongside) if alongside is not None else None
        results = list(pool.map(lambda r: solve_recipe(r, gm, ctx), recipes))
        own_result = own.result() if own is not None else None
    ctx.baselines = results
    for r in results:
        log.info("baseline %-8s %s", r.name, f"{r.objective_s:.6f} s" + ("" if r.fits else " (over budget)") if r.solution else r.note)
    return results, own_result


def best_baseline(ctx: PassContext) -> BaselineResult | None:
    """The fastest recipe that fits the budget (None when none does)."""
    feasible = [r for r in ctx.baselines if r.solution is not None and r.fits]
    return min(feasible, key=lambda r: r.objective_s) if feasible else None