"""Choose pipeline stages jointly with the intra-op plan (planning only; execution is a later step).

For each stage count S that divides the cluster into equal sub-meshes (whole nodes per stage, or a single
node split evenly) and each micro-batch count B (multiples of S that divide the global batch), the model is
planned by the intra-op solver on ONE stage's sub-mesh at the micro-batch size, cut into head / layer / tail
pieces (``pipeline_costs``), and split into S stages by the inter-op DP (``solver.inter_op``) under the memory
budget with the schedule that fits best. S = 1 is the plain intra-op plan of the whole batch on the whole
cluster. The result lists every configuration tried, fastest first.

Stage boundaries send the boundary activation forward and its gradient backward; each send moves this rank's
share of the activation (the global boundary tensor divided over the stage's devices: Megatron's
scatter/gather optimization) over the inter-node network when stages span nodes, else the intra-node link.
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

from autoshard.cluster import ClusterProfile
from autoshard.config import PlanConfig
from autoshard.offline import fake_world, mesh_names
from autoshard.pipeline_costs import piece_costs
from autoshard.solver.inter_op import SCHEDULES, StageSplit, best_split

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PipelineOption:
    """One configuration: S stages of ``submesh`` each, B micro-batches, and its solved split (None: no fit)."""

    stages: int
    submesh: tuple[int, ...]
    microbatches: int
    split: StageSplit | None
    note: str = ""

    @property
    def step_time_s(self) -> float:
        return self.split.step_time_s if self.split is not None else math.inf


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


def search_pipeline(
    model: nn.Module,
    example_inputs: Sequence[Any],
    cluster: ClusterProfile,
    config: PlanConfig,
    microbatch_options: int = 3,
    schedules: Sequence[str] = SCHEDULES,
) -> list[PipelineOption]:
    """Every (stages, micro-batches) configuration's best split, fastest first. ``config.memory_budget`` is
    the per-device budget each stage must fit."""
    from autoshard.planner import plan_graph
    from torch.distributed.device_mesh import init_device_mesh

    batch = int(example_inputs[0].shape[0])
    budget = config.memory_budget
    inner = dataclasses.replace(config, memory_budget=None, warm_start=False)
    options: list[PipelineOption] = []
    for stages, sub in stage_meshes(cluster):
        counts = [1] if stages == 1 else [b for b in (stages * 2**i for i in range(8)) if batch % b == 0][:microbatch_options]
        if not counts:
            options.append(PipelineOption(stages, sub, 0, None, f"global batch {batch} has no multiple of {stages}"))
        world = math.prod(sub)
        sub_cluster = cluster.with_size(max(1, world // cluster.devices_per_node), min(world, cluster.devices_per_node))
        for b in counts:
            with fake_world(world):
                mesh = init_device_mesh("cpu", sub, mesh_dim_names=mesh_names(sub))
                plan, gm, ctx = plan_graph(model, _micro_inputs(example_inputs, b), mesh, sub_cluster, inner)
                head, layers, tail = piece_costs(gm, ctx)
                boundary = _boundary_bytes(gm, ctx)
            link = cluster.inter_node if sub_cluster.nodes > 1 or (stages > 1 and cluster.nodes > 1) else cluster.intra_node
            p2p = link.latency + boundary / max(1, world) / link.bandwidth if stages > 1 else 0.0
            if stages == 1:
                split = best_split(layers, head, tail, 1, 1, budget, 0.0, ("GPipe",))
            else:
                split = best_split(layers, head, tail, stages, b, budget, p2p, schedules)
            note = "" if split is not None else "no split fits the memory budget"
            options.append(PipelineOption(stages, sub, b, split, note))
            log.info("pipeline: %d stages of %s, %d micro-batches: %s", stages, sub, b,
                     f"{split.step_time_s:.6f} s ({split.schedule})" if split else note)
    options.sort(key=lambda o: (o.step_time_s, o.stages))
    return options


__all__ = ["PipelineOption", "search_pipeline", "stage_meshes"]
