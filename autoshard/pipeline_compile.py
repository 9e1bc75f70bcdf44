"""``autoshard.compile`` with pipeline stages: choose the split, cut the model, plan and compile every stage.

The mesh this runs on has a ``pp`` axis outermost (the user's, or one made from the outermost axis by
``pipeline="auto"``): ``pp`` copies of a stage sub-mesh, rank-major (stage s holds global ranks s*k .. s*k+k-1).

1. Choose: for each stage count and micro-batch count, the whole model is planned on the sub-mesh at the
   micro-batch size (every rank plans the same things; rank 0's solutions are broadcast), cut into pieces
   (``pipeline_costs``) and split by the inter-op DP (``solver.inter_op.best_split``) over the schedules that run
   here. ``pipeline="auto"`` also weighs no pipeline at all (the plain plan of the whole batch on the whole mesh).
2. Cut: ``torch.distributed.pipelining.pipeline`` splits the module at the chosen layers (``SplitPoint``).
3. Plan and compile: each stage is planned on the sub-mesh (``plan_graph(stage=True)``) with its received
   activations whole (Replicate) and a parameter shared with an earlier stage pinned to that stage's layout, so
   its gradient copies can be summed shard by shard; this rank's stages are compiled (``CompiledProgram``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate

from autoshard import _torch_compat as tc
from autoshard.cluster import ClusterProfile
from autoshard.config import PlanConfig
from autoshard.pipeline_costs import piece_costs
from autoshard.pipeline_search import _boundary_bytes, _p2p_s, _with_optimizer, micro_inputs
from autoshard.plan import MeshSpec, Plan
from autoshard.planner import plan_graph, repeated_layers
from autoshard.runtime.pipeline import EXECUTABLE_SCHEDULES, LastStage, PipelinedModule, StageModule, TiedParameter
from autoshard.runtime.program import CompiledProgram
from autoshard.solver.inter_op import PieceCost, StageSplit, best_split

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PipelineChoice:
    """The chosen pipeline: stage count, micro-batches and the inter-op split (None: no pipeline wins)."""

    stages: int
    sub_shape: tuple[int, ...]
    sub_names: tuple[str, ...]
    split: StageSplit | None
    container: str
    stage_times: tuple[float, ...] = ()  # predicted forward + backward of one micro-batch, per stage (chunk)


def pp_mesh(device_type: str, stages: int, sub_shape: Sequence[int], sub_names: Sequence[str]) -> DeviceMesh:
    return init_device_mesh(device_type, (stages, *sub_shape), mesh_dim_names=("pp", *sub_names))


def _sub_of(mesh: DeviceMesh, stages: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The stage sub-mesh when the outermost axis of ``mesh`` (or all of a 1-axis ``pp`` mesh) is split into
    ``stages``; a stage of one device gets a 1-device ``dp`` axis."""
    names = tuple(mesh.mesh_dim_names or (f"d{i}" for i in range(mesh.ndim)))
    shape = tuple(mesh.shape)
    if names[0] == "pp":
        shape, names = shape[1:], names[1:]
    else:
        rest = shape[0] // stages
        shape, names = ((rest, *shape[1:]), names) if rest > 1 or len(shape) == 1 else (shape[1:], names[1:])
    return (shape, names) if shape else ((1,), ("dp",))


def choose_pipeline(
    model: nn.Module,
    inputs: Sequence[torch.Tensor],
    mesh: DeviceMesh,
    cluster: ClusterProfile,
    config: PlanConfig,
    stage_counts: Sequence[int],
    microbatches: int | None,
    schedule: str | None,
) -> PipelineChoice | None:
    """The fastest (stages, micro-batches, schedule, split) over ``stage_counts``; None when none applies."""
    found = repeated_layers(model)
    if found is None or not found[0]:
        raise ValueError(
            f"pipeline stages go between repeated layers, and {type(model).__name__} has no nn.ModuleList of "
            "identical blocks; compile it without pipeline= (or with a mesh without a 'pp' axis)"
        )
    container = found[0]
    batch = int(inputs[0].shape[0])
    schedules = (schedule,) if schedule else EXECUTABLE_SCHEDULES
    inner = dataclasses.replace(config, memory_budget=None, warm_start=False)
    best: tuple[float, PipelineChoice] | None = None
    for stages in stage_counts:
        sub_shape, sub_names = _sub_of(mesh, stages)
        submesh = _submesh(mesh.device_type, stages, sub_shape, sub_names)
        counts = [microbatches] if microbatches else [b for b in (stages * 2**i for i in range(6)) if batch % b == 0][:3]
        for b in counts:
            if batch % b:
                raise ValueError(f"microbatches={b} does not divide the global batch {batch}")
            _, gm, ctx = plan_graph(model, micro_inputs(inputs, b), submesh, cluster, inner, broadcast_solution=True)
            dev, f = cluster.device, config.optimizer_factor
            head, layers, tail = piece_costs(gm, ctx)  # each piece also runs its optimizer step once per step
            head, tail = _with_optimizer(head, dev, f), _with_optimizer(tail, dev, f)
            layers = [_with_optimizer(c, dev, f) for c in layers]
            # boundaries here are whole (Replicate): every device sends the whole activation, not its share
            k = math.prod(sub_shape)
            p2p = _p2p_s(cluster, k, stages, _boundary_bytes(gm, ctx) * k)
            split = best_split(layers, head, tail, stages, b, config.memory_budget, p2p, schedules)
            log.info("pipeline: %d stages of %s, %d micro-batches: %s", stages, sub_shape, b,
                     f"{split.step_time_s:.6f} s ({split.schedule} x{split.chunks})" if split else "no split fits")
            if split is not None and (best is None or split.step_time_s < best[0]):
                times = _stage_times(split, head, layers, tail, p2p)
                best = (split.step_time_s, PipelineChoice(stages, sub_shape, sub_names, split, container, times))
    return best[1] if best else None


def _stage_times(split: StageSplit, head: PieceCost, layers: Sequence[PieceCost], tail: PieceCost,
                 p2p: float) -> tuple[float, ...]:
    """Each stage's (chunk's) time per micro-batch: its layers, the head / tail on the first / last, and one
    send each way per boundary it touches."""
    n = len(split.layers)
    return tuple(
        sum(c.time_s for c in layers[a:b]) + (head.time_s if k == 0 else 0.0) + (tail.time_s if k == n - 1 else 0.0)
        + 2 * p2p * ((k > 0) + (k < n - 1))
        for k, (a, b) in enumerate(split.layers)
    )


def _submesh(device_type: str, stages: int, sub_shape: Sequence[int], sub_names: Sequence[str]) -> DeviceMesh:
    mesh = pp_mesh(device_type, stages, sub_shape, sub_names)
    return mesh[tuple(sub_names)] if len(sub_names) > 1 else mesh[sub_names[0]]


def _wiring(pipe: Any, n_stages: int, n_inputs: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Which model inputs stage 0 takes and which the last stage takes as its loss target; checks that every
    other stage takes exactly what its predecessor returns."""
    graph = pipe.split_gm.graph
    root = {n: i for i, n in enumerate(graph.find_nodes(op="placeholder"))}
    calls = [n for n in graph.nodes if n.op == "call_module" and n.target.startswith("submod_")]
    first, target = [], []
    for k, call in enumerate(calls):
        for a in call.args:
            src = a.args[0] if isinstance(a, fx.Node) and a.op == "call_function" and a.target is operator.getitem else a
            if src in root:
                if k == 0:
                    first.append(root[src])
                elif k == n_stages - 1:
                    target.append(root[src])
                else:
                    raise ValueError(f"model input {root[src]} is used inside pipeline stage {k}; autoshard runs "
                                     "model inputs into the first stage and one target into the last")
            elif k == 0 or src is not calls[k - 1]:
                raise ValueError(f"pipeline stage {k} uses a value of stage {calls.index(src) if src in calls else '?'}"
                                 f", not only of stage {k - 1}; torch.distributed.pipelining passes values stage to stage")
    if len(target) > 1 or set(first) & set(target):
        raise ValueError(f"the last pipeline stage takes model inputs {target} (stage 0 takes {first}); autoshard "
                         "routes exactly one input (the loss target) straight to the last stage")
    if len(first) + len(target) != n_inputs:
        raise ValueError(f"{n_inputs - len(first) - len(target)} model inputs are used by no pipeline stage")
    return tuple(first), tuple(target)


def _stage_examples(pipe: Any, mb_inputs: Sequence[torch.Tensor], routes: tuple) -> tuple[list[tuple], list[tuple]]:
    """Per stage: its inputs and outputs as real tensors of the micro-batch shapes (fake-run, no compute)."""
    first, target = routes
    fake = tc.new_fake_mode()
    ins, outs = [], []
    cur: tuple = tuple(mb_inputs[i] for i in first)
    for k in range(pipe.num_stages):
        args = cur + ((mb_inputs[target[0]],) if k == pipe.num_stages - 1 and target else ())
        with fake:
            out = pipe.get_stage_module(k)(*[fake.from_tensor(a) for a in args])
        out = out if isinstance(out, tuple) else (out,)
        ins.append(tuple(_like(a) for a in args))
        cur = tuple(_like(o) for o in out)  # a float output derived from parameters requires grad
        outs.append(cur)
    return ins, outs


def _like(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros(t.shape, dtype=t.dtype).requires_grad_(t.requires_grad)


def compile_pipelined(
    model: nn.Module,
    mesh: DeviceMesh,
    inputs: Sequence[torch.Tensor],
    cluster: ClusterProfile,
    config: PlanConfig,
    backend: str,
    choice: PipelineChoice,
) -> PipelinedModule:
    from torch.distributed.pipelining import SplitPoint, pipeline

    split = choice.split
    assert split is not None
    S, M = choice.stages, split.microbatches
    full = pp_mesh(mesh.device_type, S, choice.sub_shape, choice.sub_names)
    names = choice.sub_names
    submesh = full[tuple(names)] if len(names) > 1 else full[names[0]]
    k_sub = math.prod(choice.sub_shape)
    rank = dist.get_rank()
    pp_rank, local_index = divmod(rank, k_sub)
    mb = micro_inputs(inputs, M)
    spec = {f"{choice.container}.{start}": SplitPoint.BEGINNING for start, _ in split.layers[1:]}
    pipe = pipeline(model, mb_args=tuple(mb), split_spec=spec)
    n = pipe.num_stages
    routes = _wiring(pipe, n, len(inputs))
    ex_in, ex_out = _stage_examples(pipe, mb, routes)
    placements: dict[str, str] = {}  # parameter -> layout of the first stage holding it
    holders: dict[str, list[int]] = {}
    stage_plans: list[Plan] = []
    stage_specs: list[Any] = []
    local: dict[int, nn.Module] = {}
    rep = [Replicate()] * len(names)
    for k in range(n):
        mod = pipe.get_stage_module(k)
        pnames = [p for p, _ in mod.named_parameters(remove_duplicate=False)]
        pins: dict[str, Any] = dict(config.constraints)
        n_recv = 0 if k == 0 else len(ex_out[k - 1])
        pins.update({f"input[{i}]": rep for i in range(n_recv)})
        pins.update({p: placements[p] for p in pnames if p in placements})
        cfg = dataclasses.replace(config, constraints=pins, warm_start=False)
        plan, gm, ctx = plan_graph(mod, ex_in[k], submesh, cluster, cfg, broadcast_solution=True, stage=True)
        for p, pl in plan.parameter_placements().items():
            placements.setdefault(p, pl)
        for p in pnames:
            holders.setdefault(p, []).append(k)
        start, stop = split.layers[k]
        # the stage's modules outside the repeated layers (embeddings first on stage 0, the head last)
        extra = list(dict.fromkeys(p.rpartition(".")[0] for p in pnames if not p.startswith(choice.container + ".")))
        body = [f"{choice.container}.{i}" for i in range(start, stop)]
        layers = tuple(extra + body if k == 0 else body + extra)
        ranks = tuple(range((k % S) * k_sub, (k % S + 1) * k_sub))
        stage_plans.append(plan)
        stage_specs.append(dataclasses.replace(plan.stages[0], index=k, ranks=ranks, layers=layers,
                                               microbatch_time_s=choice.stage_times[k]))
        if k % S == pp_rank:
            grad_names = [r.name for r in ctx.output_roles if r.kind in ("grad", "input_grad")]
            sm = StageModule(mod, submesh, plan, CompiledProgram(gm, ctx, backend), grad_names)
            local[k] = LastStage(sm) if k == n - 1 else sm
    tied = _tied_groups(holders, S, k_sub)
    combined = Plan(
        mesh=MeshSpec((S, *choice.sub_shape), ("pp", *names)),
        cluster=stage_plans[0].cluster,
        stages=tuple(stage_specs),
        step_time_s=split.step_time_s,
        solver=stage_plans[0].solver,
        schedule=split.schedule,
        microbatches=M,
        chunks=split.chunks,
        bubble_fraction=split.bubble_fraction,
        model=type(model).__name__,
        memory_budget_bytes=stage_plans[0].memory_budget_bytes,
    )
    # what each stage receives and sends (the last one's target comes from the schedule, not a send); received
    # float activations need their gradient, which pipelining reads off this metadata
    def meta(ts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return tuple(t.detach().requires_grad_(t.requires_grad) for t in ts)

    received = {k: ex_in[k][:-1] if k == n - 1 and routes[1] else ex_in[k] for k in local}
    stage_in = {k: meta(v) if k > 0 else tuple(t.detach() for t in v) for k, v in received.items()}
    stage_out = {k: meta(ex_out[k]) if k < n - 1 else stage_in[k] for k in local}
    device = torch.device(mesh.device_type)
    return PipelinedModule(combined, local, n, full.get_group("pp"), pp_rank, stage_in, stage_out, routes, tied,
                           local_index, device, frozenset(model.state_dict()))


def _tied_groups(holders: dict[str, list[int]], S: int, k_sub: int) -> list[TiedParameter]:
    """Process groups over the ranks holding copies of each parameter that lives in several stages (made on
    every rank in the same order, as ``new_group`` requires)."""
    out = []
    for name in sorted(holders):
        stages = holders[name]
        if len(stages) < 2:
            continue
        owners = sorted({s % S for s in stages})
        groups: list[Any] = []
        for j in range(k_sub):
            groups.append(dist.new_group([o * k_sub + j for o in owners]) if len(owners) > 1 else None)
        out.append(TiedParameter(name, tuple(stages), tuple(groups)))
    return out


__all__ = ["PipelineChoice", "choose_pipeline", "compile_pipelined", "pp_mesh"]
