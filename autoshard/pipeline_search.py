"""Choose pipeline stages jointly with the intra-op plan (planning only; execution is a later step).

For each stage count S that divides the cluster into equal sub-meshes (whole nodes per stage, or a single
node split evenly) and each micro-batch count B (:func:`microbatch_counts`), the model is planned by the
intra-op solver on ONE stage's sub-mesh at the micro-batch size, cut into head / layer / tail pieces
(``pipeline_costs``), and split into S stages by the inter-op DP (``solver.inter_op``) under the memory budget
with the schedule that fits best, with or without activation recomputation. S = 1 is the plain intra-op plan of
the whole cluster, over the whole batch at once or accumulating gradients over B micro-batches. The result
lists every configuration tried, fastest first.

Stage boundaries send the boundary activation forward and its gradient backward; each send moves this rank's
share of the activation (the global boundary tensor divided over the stage's devices: Megatron's
scatter/gather optimization) over the inter-node network when stages span nodes, else the intra-node link.
The optimizer step runs once per step on every device over its own training state; it is memory-bound
(:func:`optimizer_step_s`) and is added to each piece's once-per-step work.

Fixed configurations. :func:`evaluate_config` prices a manual TP x PP x DP layout the way Megatron-LM runs it:
each stage is a ``dp x tp`` sub-mesh planned with the intra-op recipe pinned (``tp``: Megatron's column/row
parallel layers on the ``tp`` axis, batch and replicated parameters on ``dp``; ``ddp`` when tp = 1), the layers
are split evenly (``inter_op.even_split``), and the schedule is 1F1B or interleaved 1F1B. :func:`megatron_baseline`
is Megatron's recipe ("pp+tp+dp"): TP = the devices of a node, the smallest PP (whole nodes per stage) whose
stages fit the memory budget, DP over the rest, micro-batches of 1 or 2 sequences per data-parallel rank.
``search_pipeline(..., baseline=True)`` lists it among the options (``recipe == "pp+tp+dp"``), so the search says
how its own choice compares; free options have ``recipe == ""``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoshard.cluster import ClusterProfile, DeviceSpec
from autoshard.config import PlanConfig
from autoshard.offline import fake_world, mesh_names
from autoshard.pipeline_costs import piece_costs
from autoshard.solver.inter_op import SCHEDULES, PieceCost, StageSplit, best_split

log = logging.getLogger(__name__)

MEGATRON_SCHEDULES = ("1F1B", "Interleaved1F1B")  # what Megatron-LM ran in 2021 (Narayanan et al., SC21)
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


def _with_optimizer(c: PieceCost, device: DeviceSpec, factor: int) -> PieceCost:
    return dataclasses.replace(c, step_s=c.step_s + optimizer_step_s(c.state_bytes, device, factor))


def _boundary_bytes(gm: Any, ctx: Any) -> int:
    """Global bytes of the activation entering the first repeated layer (what a stage boundary sends)."""
    from autoshard.passes.coarsen import layer_key

    group_of = {name: g for g in ctx.groups for name in g.members}
    best = 0
    for node in gm.graph.nodes:
        g = group_of.get(node.name)
        if g is None or g.phase != "forward" or layer_key(g.module) is None:
            continue
        for a in node.all_input_nodes:
            src = group_of.get(a.name)
            v = a.meta.get("val")
            if src is not None and layer_key(src.module) is None and src.kind == "op" and isinstance(v, torch.Tensor):
                best = max(best, v.numel() * v.element_size())
        if best:
            return best
    return best


def _micro_inputs(inputs: Sequence[Any], parts: int) -> tuple:
    out = []
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.ndim and x.shape[0] % parts == 0:
            out.append(x[: x.shape[0] // parts])
        else:
            out.append(x)
    return tuple(out)


def layout_summary(plan: Any, limit: int = 6) -> str:
    """The mesh and the placements of the first input and of the weight matrices (one line per distinct
    parameter name, layer indices folded to ``*``), e.g. ``dp=6 x tp=8; tokens [S(0), R]; wte [S(0), S(1)]``."""
    import re

    stage = plan.stages[0]
    parts = [" x ".join(f"{n}={s}" for n, s in zip(plan.mesh.names, plan.mesh.shape))]
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


def _p2p_s(cluster: ClusterProfile, world: int, stages: int, boundary: int) -> float:
    """One boundary send: this device's share of the boundary activation over the link between stages."""
    if stages <= 1:
        return 0.0
    spans = world > cluster.devices_per_node or (cluster.nodes > 1 and world * stages > cluster.devices_per_node)
    link = cluster.inter_node if spans else cluster.intra_node
    return link.latency + boundary / max(1, world) / link.bandwidth


def _plan_pieces(
    model: nn.Module, inputs: Sequence[Any], sub: tuple[int, ...], names: tuple[str, ...], cluster: ClusterProfile,
    config: PlanConfig, microbatches: int, stages: int,
) -> tuple[tuple[PieceCost, list[PieceCost], PieceCost], float, str]:
    """Plan the whole model on one stage's sub-mesh at the micro-batch size: (pieces with the optimizer step,
    one boundary send's time, layout summary)."""
    from torch.distributed.device_mesh import init_device_mesh

    from autoshard.planner import plan_graph

    world = math.prod(sub)
    with fake_world(world):
        mesh = init_device_mesh("cpu", sub, mesh_dim_names=names)
        plan, gm, ctx = plan_graph(model, _micro_inputs(inputs, microbatches), mesh, _sub_cluster(cluster, world),
                                   config)
        head, layers, tail = piece_costs(gm, ctx)
        boundary = _boundary_bytes(gm, ctx)
    dev, f = cluster.device, config.optimizer_factor
    pieces = (_with_optimizer(head, dev, f), [_with_optimizer(c, dev, f) for c in layers], _with_optimizer(tail, dev, f))
    return pieces, _p2p_s(cluster, world, stages, boundary), layout_summary(plan)


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
    baseline: bool = False,
) -> list[PipelineOption]:
    """Every (stages, micro-batches) configuration's best split, fastest first. ``config.memory_budget`` is
    the per-device budget each stage must fit. ``recompute``: None lets each split use activation recomputation
    where only it fits (or it is faster); True/False fixes it. ``stage_options`` limits the stage counts tried;
    ``baseline`` adds Megatron's recipe (:func:`megatron_baseline`) to the options."""
    from autoshard.planner import repeated_layers

    batch = int(example_inputs[0].shape[0])
    budget = config.memory_budget
    inner = dataclasses.replace(config, memory_budget=None, warm_start=False)
    found = repeated_layers(model)
    depth = found[1] if found else None
    options: list[PipelineOption] = []
    for stages, sub in stage_meshes(cluster):
        if stage_options is not None and stages not in stage_options:
            continue
        if depth is not None and stages > depth:
            continue  # a stage needs at least one layer
        world = math.prod(sub)
        counts = microbatch_counts(batch, stages, world, cluster.devices_per_node)
        if not counts:
            options.append(PipelineOption(stages, sub, 0, None, f"global batch {batch} has no multiple of {stages}"))
            continue

        def attempt(b: int, stages: int = stages, sub: tuple[int, ...] = sub, world: int = world) -> PipelineOption:
            (head, layers, tail), p2p, layout = _plan_pieces(model, example_inputs, sub, mesh_names(sub), cluster,
                                                             inner, b, stages)
            # one stage runs the micro-batches one after another: 1F1B with S = 1 is gradient accumulation
            sched = ("GPipe",) if b == 1 else ("1F1B",) if stages == 1 else schedules
            split = best_split(layers, head, tail, stages, b, budget, p2p, sched, recompute=recompute)
            note = "" if split is not None else "no split fits the memory budget"
            log.info("pipeline: %d stages of %s, %d micro-batches: %s", stages, sub, b,
                     f"{split.step_time_s:.6f} s ({split.schedule}{', recompute' if split.recompute else ''})"
                     if split else note)
            return PipelineOption(stages, sub, b, split, note, layout=layout)

        if stages > 1:
            options += _climb(counts, attempt, microbatch_options)
            continue
        for b in counts[:microbatch_options]:
            options.append(attempt(b))
            # no bubble: the fewest micro-batches that fit without recomputation are the fastest
            if options[-1].split is not None and not options[-1].split.recompute:
                break
    if baseline:
        options.append(megatron_baseline(model, example_inputs, cluster, config))
    options.sort(key=lambda o: (o.step_time_s, o.stages, o.recipe))
    return options


def _climb(counts: Sequence[int], attempt: Any, budget: int) -> list[PipelineOption]:
    """Plan at most ``budget`` of the pipeline's micro-batch ``counts`` (sorted): the middle one, then walk
    towards the neighbour that is faster while it keeps getting faster (the step time is taken to be unimodal
    in B: the bubble shrinks with more micro-batches, the per-micro-batch efficiency and the memory headroom
    with fewer). From a start that does not fit, the walk goes to more (smaller) micro-batches first."""
    tried: dict[int, PipelineOption] = {}

    def at(i: int) -> float:
        if i not in tried:
            tried[i] = attempt(counts[i])
        return tried[i].step_time_s

    first = i = len(counts) // 2
    for step in ((1, -1) if math.isinf(at(first)) else (-1, 1)):
        while len(tried) < budget and 0 <= i + step < len(counts) and (i + step) not in tried:
            if at(i + step) < at(i) or math.isinf(at(i)):
                i += step
            else:
                break
        if i != first:
            break  # it moved one way: the other way was not better from the start
    return list(tried.values())


def evaluate_config(
    model: nn.Module,
    example_inputs: Sequence[Any],
    cluster: ClusterProfile,
    config: PlanConfig,
    *,
    tp: int,
    pp: int,
    microbatches: int,
    dp: int | None = None,
    schedule: str | None = None,
    recompute: bool | None = True,
    max_chunks: int = 4,
) -> PipelineOption:
    """A fixed Megatron-style layout: ``pp`` stages of ``dp x tp`` devices (TP on the inner, intra-node axis;
    stages and DP outside it), ``microbatches`` micro-batches, layers split evenly, intra-op recipe pinned
    (``tp``, or ``ddp`` when tp = 1). ``schedule`` None: the faster of 1F1B and interleaved 1F1B (chunks up to
    ``max_chunks`` that divide the layers evenly); one stage accumulates gradients (1F1B with S = 1)."""
    n = cluster.num_devices()
    dp = n // (tp * pp) if dp is None else dp
    if tp * pp * dp != n or min(tp, pp, dp) < 1:
        raise ValueError(f"tp={tp} x pp={pp} x dp={dp} = {tp * pp * dp} devices, but {cluster.name} has {n}")
    batch = int(example_inputs[0].shape[0])
    if batch % microbatches or (batch // microbatches) % dp:
        raise ValueError(f"global batch {batch} in {microbatches} micro-batches does not split over dp={dp}; "
                         f"use a micro-batch count that divides {batch} into multiples of {dp} sequences")
    sub, names = ((dp, tp), ("dp", "tp")) if dp > 1 and tp > 1 else ((tp,), ("tp",)) if tp > 1 else ((dp,), ("dp",))
    recipe = "tp" if tp > 1 else "ddp"
    inner = dataclasses.replace(config, memory_budget=None, warm_start=False, recipe=recipe)
    budget = config.memory_budget
    (head, layers, tail), p2p, layout = _plan_pieces(model, example_inputs, sub, names, cluster, inner, microbatches,
                                                     pp)
    scheds = (schedule,) if schedule else ("1F1B",) if pp == 1 else MEGATRON_SCHEDULES
    split = best_split(layers, head, tail, pp, microbatches, budget, p2p, scheds, max_chunks, recompute, even=True)
    note = "" if split is not None else "does not fit the memory budget"
    log.info("config tp=%d pp=%d dp=%d, %d micro-batches: %s", tp, pp, dp, microbatches,
             f"{split.step_time_s:.6f} s ({split.schedule} x{split.chunks})" if split else note)
    return PipelineOption(pp, sub, microbatches, split, note, recipe=recipe, layout=layout)


def megatron_baseline(
    model: nn.Module,
    example_inputs: Sequence[Any],
    cluster: ClusterProfile,
    config: PlanConfig,
    *,
    microbatch_sizes: Sequence[int] = (1, 2),
    recompute: bool | None = True,
) -> PipelineOption:
    """Megatron-LM's recipe ("pp+tp+dp"): TP = devices per node, PP = the smallest number of whole-node stages
    whose stages fit ``config.memory_budget`` (the device's memory when None), DP = the remaining nodes; of the
    micro-batch sizes (sequences per data-parallel rank) the faster that fits. Full activation recomputation,
    as Megatron's GPT runs use (``recompute=None`` would use it only where needed)."""
    from autoshard.planner import repeated_layers

    if config.memory_budget is None:
        config = dataclasses.replace(config, memory_budget=cluster.device.memory_bytes)
    tp, nodes = cluster.devices_per_node, cluster.nodes
    found = repeated_layers(model)
    depth = found[1] if found else 1
    batch = int(example_inputs[0].shape[0])
    tried = []
    for pp in (p for p in range(1, nodes + 1) if nodes % p == 0 and p <= depth):
        dp = nodes // pp
        best: PipelineOption | None = None
        for mbs in microbatch_sizes:
            if batch % (dp * mbs) or batch // (dp * mbs) < pp:
                continue
            o = evaluate_config(model, example_inputs, cluster, config, tp=tp, pp=pp, dp=dp,
                                microbatches=batch // (dp * mbs), recompute=recompute)
            if o.split is not None and (best is None or o.step_time_s < best.step_time_s):
                best = o
        if best is not None:
            return dataclasses.replace(best, recipe=BASELINE, note=f"tp={tp} pp={pp} dp={dp}")
        tried.append(pp)
    return PipelineOption(0, (), 0, None, f"{BASELINE}: no PP in {tried} fits the memory budget", recipe=BASELINE)


__all__ = ["BASELINE", "MEGATRON_SCHEDULES", "PipelineOption", "evaluate_config", "layout_summary",
           "megatron_baseline", "microbatch_counts", "optimizer_step_s", "search_pipeline", "stage_meshes"]
