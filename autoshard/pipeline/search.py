"""Choose pipeline stages jointly with the intra-op plan (planning only; execution is a later step).

For each stage count S that divides the cluster into equal sub-meshes (whole nodes per stage, or a single
node split evenly) and each micro-batch count B (:func:`microbatch_counts`), the model is planned by the
intra-op solver on ONE stage's sub-mesh at the micro-batch size, cut into head / layer / tail pieces
(``pipeline.costs``), and split into S stages by the inter-op DP (``solver.inter_op``) under the memory budget
with the schedule that fits best, with or without activation recomputation. S = 1 is the plain intra-op plan of
the whole cluster, over the whole batch at once or accumulating gradients over B micro-batches. The result
lists every configuration tried, fastest first.

How much is planned. Each (S, B) costs one intra-op plan (seconds), so B is walked, not enumerated: from the
middle of the candidate counts towards the faster neighbour while it gets faster (at most
``microbatch_options`` plans per S; one stage takes the fewest micro-batches that fit without recomputation).
``walk_stages=True`` walks the stage counts the same way from :func:`stage_start` (for clusters of hundreds of
nodes); by default every S is planned. The intra-op plan is solved for time alone; where the stage memory budget
binds, the leaner manual recipes (fsdp+tp, fsdp, tp, ddp) are solved on the same program and split too, and
the fastest split wins (``PipelineOption.recipe`` names the recipe then).

Stage boundaries send the boundary activation forward and its gradient backward; each send moves this rank's
share of the activation (the global boundary tensor divided over the stage's devices: Megatron's
scatter/gather optimization) over the inter-node network when stages span nodes, else the intra-node link.
The optimizer step runs once per step on every device over its own training state; it is memory-bound
(:func:`optimizer_step_s`) and is added to each piece's once-per-step work.

Megatron-LM's fixed configurations are priced in ``pipeline.megatron``; their rows have ``recipe ==
"pp+tp+dp"``, free options ``recipe == ""``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoshard.cluster import ClusterProfile, DeviceSpec
from autoshard.config import PlanConfig
from autoshard.meshes import fake_world, mesh_names
from autoshard.pipeline.costs import piece_costs
from autoshard.solver.inter_op import SCHEDULES, PieceCost, StageSplit, best_split

log = logging.getLogger(__name__)

BASELINE = "pp+tp+dp"


@dataclass(frozen=True)
class PipelineOption:
    """One configuration: S stages of ``submesh`` each, B micro-batches, and its solved split (None: no fit)."""

    stages: int
    submesh: tuple[int, ...]
    microbatches: int
    split: StageSplit | None
    note: str = ""
    recipe: str = ""  # "": free intra-op plan and DP split; "tp"/"ddp": a fixed layout; "pp+tp+dp": Megatron's recipe
    layout: str = ""  # the stage plan's layouts, e.g. "dp=6 x tp=8; tokens [S(0), R]; layers.*.attn.wq [R, S(0)]"

    @property
    def step_time_s(self) -> float:
        return self.split.step_time_s if self.split is not None else math.inf

    @property
    def recompute(self) -> bool:
        return self.split is not None and self.split.recompute


def stage_meshes(cluster: ClusterProfile) -> list[tuple[int, tuple[int, ...]]]:
    """(stages, stage sub-mesh shape) options: whole nodes per stage (S | nodes), or one node split evenly."""
    per, nodes = cluster.devices_per_node, cluster.nodes
    out = []
    for s in range(1, nodes + 1):
        if nodes % s == 0:
            k = nodes // s
            out.append((s, (k, per) if k > 1 else (per,)))
    if nodes == 1:
        for s in range(2, per + 1):
            if per % s == 0:
                out.append((s, (per // s,)))
    return out


def microbatch_counts(batch: int, stages: int, world: int, per_node: int) -> list[int]:
    """Micro-batch counts B worth planning for S stages of ``world`` devices, fewest first: micro-batches of m
    sequences, m from one per node of the stage (a node-wide TP group's micro-batch size 1) doubling up to
    ``batch / S``, where B = batch / m is whole and >= S; one stage also takes the whole batch (B = 1)."""
    counts, m = [], max(1, world // per_node)
    while m <= batch // stages:
        if batch % m == 0:
            counts.append(batch // m)
        m *= 2
    if stages == 1 and 1 not in counts:
        counts.append(1)
    return sorted(counts)


def optimizer_step_s(state_bytes: float, device: DeviceSpec, factor: int) -> float:
    """The optimizer update over ``state_bytes`` of training state (parameters, gradients and ``factor`` x the
    parameters in optimizer state): it reads all of it and writes back all but the gradients, at the device's
    streaming bandwidth (an elementwise, memory-bound kernel, as AdamW's foreach/fused updates are)."""
    if state_bytes <= 0:
        return 0.0
    written = (1 + factor) / (2 + factor)  # parameters + optimizer state, of parameters + gradients + state
    return state_bytes * (1 + written) / (device.memory_bandwidth * device.memory_efficiency)


def with_optimizer(c: PieceCost, device: DeviceSpec, factor: int) -> PieceCost:
    return dataclasses.replace(c, step_s=c.step_s + optimizer_step_s(c.state_bytes, device, factor))


def _boundary_node(gm: Any, ctx: Any) -> Any:
    """The largest activation entering the first repeated layer from outside (what a stage boundary sends)."""
    from autoshard.ir import layer_key

    group_of = {name: g for g in ctx.groups for name in g.members}
    best, size = None, 0
    for node in gm.graph.nodes:
        g = group_of.get(node.name)
        if g is None or g.phase != "forward" or layer_key(g.module) is None:
            continue
        for a in node.all_input_nodes:
            src = group_of.get(a.name)
            v = a.meta.get("val")
            if src is not None and layer_key(src.module) is None and src.kind == "op" and isinstance(v, torch.Tensor):
                if v.numel() * v.element_size() > size:
                    best, size = a, v.numel() * v.element_size()
        if best is not None:
            return best
    return best


def boundary_bytes(gm: Any, ctx: Any) -> int:
    """Global bytes of the activation entering the first repeated layer (what a stage boundary sends)."""
    node = _boundary_node(gm, ctx)
    return 0 if node is None else node.meta["val"].numel() * node.meta["val"].element_size()


def micro_inputs(inputs: Sequence[Any], parts: int) -> tuple:
    """The first micro-batch of each batched input (the batch dim cut into ``parts``); others unchanged."""
    return tuple(x[: x.shape[0] // parts] if isinstance(x, torch.Tensor) and x.ndim and x.shape[0] % parts == 0
                 else x for x in inputs)


def layout_summary(plan: Any, limit: int = 10, activation: str = "") -> str:
    """The mesh, ``activation`` (e.g. the layers' input placement) and the placements of the first input and of
    the weight matrices (one entry per distinct parameter name, layer indices folded to ``*``), e.g.
    ``dp=6 x tp=8; act [S(0), R]; tokens [S(0), R]; wte [S(0), S(1)]``."""
    import re

    stage = plan.stages[0]
    parts = [" x ".join(f"{n}={s}" for n, s in zip(plan.mesh.names, plan.mesh.shape))]
    limit += bool(activation)
    if activation:
        parts.append(activation)
    seen: set[str] = set()
    inputs = [t for t in stage.tensors if t.role == "input"]
    weights = [t for t in stage.tensors if t.role == "parameter" and len(t.shape) >= 2]
    for t in inputs[:1] + weights:
        name = re.sub(r"\.\d+\.", ".*.", t.name).removesuffix(".weight")
        if name in seen:
            continue
        seen.add(name)
        parts.append(f"{name} [{', '.join(t.placements)}]")
        if len(parts) > limit:
            break
    return "; ".join(parts)


def _sub_cluster(cluster: ClusterProfile, world: int) -> ClusterProfile:
    per = cluster.devices_per_node
    return cluster.with_size(max(1, world // per), min(world, per))


def p2p_seconds(cluster: ClusterProfile, world: int, stages: int, boundary: int) -> float:
    """One boundary send: this device's share of the boundary activation over the link between stages."""
    if stages <= 1:
        return 0.0
    spans = world > cluster.devices_per_node or (cluster.nodes > 1 and world * stages > cluster.devices_per_node)
    link = cluster.inter_node if spans else cluster.intra_node
    return link.latency + boundary / max(1, world) / link.bandwidth


SplitFn = Callable[[PieceCost, list[PieceCost], PieceCost, float, int | None], StageSplit | None]
FALLBACK_RECIPES = ("fsdp+tp", "fsdp", "tp", "ddp")


def plan_split(
    model: nn.Module, inputs: Sequence[Any], sub: tuple[int, ...], names: tuple[str, ...], cluster: ClusterProfile,
    config: PlanConfig, microbatches: int, stages: int, split: SplitFn, budget: int | None,
    fallback: Sequence[str] = (),
) -> tuple[StageSplit | None, str, str]:
    """Plan the whole model on one stage's sub-mesh at the micro-batch size, cost its pieces (with the optimizer
    step) and split them with ``split(head, layers, tail, p2p_s, budget)``: (split, layout summary, recipe).

    The intra-op plan is solved for time alone (a stage's budget is not a budget on the whole model). When
    memory binds (its split does not fit ``budget``, or fits only slower than it would without it), the
    ``fallback`` recipes that apply to the sub-mesh are solved on the same program (``baselines.solve_recipe``)
    and the fastest split of all is kept, the recipe's name in the third field."""
    from torch.distributed.device_mesh import init_device_mesh

    from autoshard.passes.solve_recipes import solve_recipe
    from autoshard.solver.recipes import applicable
    from autoshard.notation import placement_str
    from autoshard.passes.solve import annotate
    from autoshard.planner import build_plan, plan_graph

    world = math.prod(sub)
    dev, f = cluster.device, config.optimizer_factor
    with fake_world(world):
        mesh = init_device_mesh("cpu", sub, mesh_dim_names=names)
        plan, gm, ctx = plan_graph(model, micro_inputs(inputs, microbatches), mesh, _sub_cluster(cluster, world),
                                   config)
        node = _boundary_node(gm, ctx)
        p2p = p2p_seconds(cluster, world, stages, 0 if node is None else node.meta["val"].numel() * node.meta["val"].element_size())

        def pieces(sol: Any) -> tuple[PieceCost, list[PieceCost], PieceCost]:
            head, layers, tail = piece_costs(gm, ctx, sol)
            return (with_optimizer(head, dev, f), [with_optimizer(c, dev, f) for c in layers],
                    with_optimizer(tail, dev, f))

        def cost(sol: Any, p: Any, recipe: str) -> tuple[StageSplit | None, str, str]:
            act = "" if node is None else f"act [{', '.join(placement_str(x) for x in node.meta['autoshard'].outputs[0])}]"
            return split(*pieces(sol), p2p, budget), layout_summary(p, activation=act), recipe

        best = cost(ctx.solution, plan, config.recipe or "")
        free = split(*pieces(ctx.solution), p2p, None) if fallback and best[0] is not None else None
        if best[0] is None or (free is not None and free.step_time_s < best[0].step_time_s * (1 - 1e-9)):
            for recipe in (r for r in fallback if r in applicable(sub)):
                res = solve_recipe(recipe, gm, ctx)
                if res.solution is None:
                    continue
                annotate(gm, ctx, res.solution)
                got = cost(res.solution, build_plan(gm, ctx, res.solution, recipe=recipe), recipe)
                if got[0] is not None and (best[0] is None or got[0].step_time_s < best[0].step_time_s):
                    best = got
            annotate(gm, ctx)
    return best


def search_pipeline(
    model: nn.Module,
    example_inputs: Sequence[Any],
    cluster: ClusterProfile,
    config: PlanConfig,
    microbatch_options: int = 3,
    schedules: Sequence[str] = SCHEDULES,
    *,
    recompute: bool | None = None,
    stage_options: Sequence[int] | None = None,
    walk_stages: bool = False,
) -> list[PipelineOption]:
    """Every (stages, micro-batches) configuration's best split, fastest first. ``config.memory_budget`` is
    the per-device budget each stage must fit. ``recompute``: None lets each split use activation recomputation
    where only it fits (or it is faster); True/False fixes it. ``stage_options`` limits the stage counts tried.
    ``walk_stages`` plans only some stage counts: from :func:`stage_start` towards the faster neighbour while
    it gets faster (the step time taken to be unimodal in S, as in B), instead of every one.
    (``pipeline.megatron.megatron_baseline`` prices Megatron's recipe to compare with.)"""
    from autoshard.planner import repeated_layers

    found = repeated_layers(model)
    depth = found[1] if found else None
    ladder = [(s, sub) for s, sub in stage_meshes(cluster)
              if (stage_options is None or s in stage_options) and (depth is None or s <= depth)]
    per_stages: dict[int, list[PipelineOption]] = {}

    def best_of(i: int) -> float:
        stages, sub = ladder[i]
        per_stages[i] = _stage_options(model, example_inputs, cluster, config, stages, sub, microbatch_options,
                                       schedules, recompute)
        return min((o.step_time_s for o in per_stages[i]), default=math.inf)

    if walk_stages and ladder:
        start = stage_start(model, cluster, config, [s for s, _ in ladder])
        _walk(len(ladder), best_of, len(ladder), [s for s, _ in ladder].index(start))
    else:
        for i in range(len(ladder)):
            best_of(i)
    options = [o for i in sorted(per_stages) for o in per_stages[i]]
    options.sort(key=lambda o: (o.step_time_s, o.stages, o.recipe))
    return options


def stage_start(model: nn.Module, cluster: ClusterProfile, config: PlanConfig, counts: Sequence[int]) -> int:
    """Where a stage walk starts: the fewest stages (of ``counts``) whose share of the training state
    (parameters, gradients, optimizer state) fits a node's devices within the memory budget, as with TP over
    the node and the state replicated over DP (Megatron users' rule for the pipeline depth)."""
    budget = config.memory_budget or cluster.device.memory_bytes
    state = sum(p.numel() * p.element_size() for p in model.parameters()) * (2 + config.optimizer_factor)
    per_node = cluster.devices_per_node * budget
    return next((s for s in sorted(counts) if state / s <= per_node), max(counts))


def _stage_options(
    model: nn.Module, example_inputs: Sequence[Any], cluster: ClusterProfile, config: PlanConfig, stages: int,
    sub: tuple[int, ...], microbatch_options: int, schedules: Sequence[str], recompute: bool | None,
) -> list[PipelineOption]:
    """The options planned for S = ``stages`` stages of ``sub``: up to ``microbatch_options`` micro-batch counts."""
    batch = int(example_inputs[0].shape[0])
    budget = config.memory_budget
    inner = dataclasses.replace(config, memory_budget=None, solve_recipes=False)
    world = math.prod(sub)
    counts = microbatch_counts(batch, stages, world, cluster.devices_per_node)
    if not counts:
        return [PipelineOption(stages, sub, 0, None, f"global batch {batch} has no multiple of {stages}")]
    tried: dict[int, PipelineOption] = {}

    def attempt(i: int) -> float:
        b = counts[i]
        # one stage runs the micro-batches one after another: 1F1B with S = 1 is gradient accumulation
        sched = ("GPipe",) if b == 1 else ("1F1B",) if stages == 1 else schedules

        def fn(head: PieceCost, layers: list[PieceCost], tail: PieceCost, p2p: float,
               limit: int | None) -> StageSplit | None:
            return best_split(layers, head, tail, stages, b, limit, p2p, sched, recompute=recompute)

        split, layout, recipe = plan_split(model, example_inputs, sub, mesh_names(sub), cluster, inner, b, stages,
                                            fn, budget, FALLBACK_RECIPES if budget is not None else ())
        note = "" if split is not None else "no split fits the memory budget"
        log.info("pipeline: %d stages of %s, %d micro-batches: %s", stages, sub, b,
                 f"{split.step_time_s:.6f} s ({split.schedule}{', recompute' if split.recompute else ''}"
                 f"{', recipe ' + recipe if recipe else ''})" if split else note)
        tried[i] = PipelineOption(stages, sub, b, split, note, recipe=recipe, layout=layout)
        return tried[i].step_time_s

    if stages > 1:
        _walk(len(counts), attempt, microbatch_options, len(counts) // 2)
    else:
        for i in range(min(microbatch_options, len(counts))):
            # no bubble: the fewest micro-batches that fit without recomputation are the fastest
            attempt(i)
            if tried[i].split is not None and not tried[i].split.recompute:
                break
    return [tried[i] for i in sorted(tried)]


def _walk(n: int, value: Callable[[int], float], budget: int, first: int) -> None:
    """Evaluate ``value`` at most ``budget`` times over indices 0..n-1: at ``first``, then towards the
    neighbour that is smaller while it keeps getting smaller (``value`` taken to be unimodal; for the
    micro-batch counts of a pipeline, sorted: the bubble shrinks with more micro-batches, the per-micro-batch
    efficiency and the memory headroom with fewer). From an infinite start (nothing fits) it goes up first."""
    seen: dict[int, float] = {}

    def at(i: int) -> float:
        if i not in seen:
            seen[i] = value(i)
        return seen[i]

    i = first
    for step in ((1, -1) if math.isinf(at(first)) else (-1, 1)):
        while len(seen) < budget and 0 <= i + step < n and (i + step) not in seen:
            if at(i + step) < at(i) or math.isinf(at(i)):
                i += step
            else:
                break
        if i != first:
            break  # it moved one way: the other way was not better from the start


__all__ = ["BASELINE", "PipelineOption", "boundary_bytes", "layout_summary", "microbatch_counts", "optimizer_step_s",
           "p2p_seconds", "plan_split", "search_pipeline", "stage_meshes", "stage_start", "with_optimizer"]
