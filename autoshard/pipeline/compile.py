"""``autoshard.compile`` with pipeline stages: choose the split, cut the model, plan and compile every stage.

The mesh this runs on has a ``pp`` axis outermost (the user's, or one made from the outermost axis by
``pipeline="auto"``): ``pp`` copies of a stage sub-mesh, rank-major (stage s holds global ranks s*k .. s*k+k-1).

1. Choose: for each stage count and micro-batch count, the whole model is planned on the sub-mesh at the
   micro-batch size (every rank plans the same things; rank 0's solutions are broadcast), cut into pieces
   (``pipeline.costs``) and split by the inter-op DP (``solver.inter_op.best_split``) over the schedules that run
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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate

from autoshard.cluster import ClusterProfile
from autoshard.config import PlanConfig
from autoshard.pipeline.costs import piece_costs
from autoshard.inputs import Call, signature_of
from autoshard.pipeline.search import boundary_bytes, p2p_seconds, with_optimizer
from autoshard.pipeline.wiring import StageWiring, loss_counter, split_model, stage_examples
from autoshard.plan import MeshSpec, Plan
from autoshard.planner import pipeline_layers, plan_graph
from autoshard.runtime.pipeline import EXECUTABLE_SCHEDULES, LossWeighting, PipelinedModule, StageModule, TiedParameter
from autoshard.passes.runner import rank_program
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
    inputs: Any,
    mesh: DeviceMesh,
    cluster: ClusterProfile,
    config: PlanConfig,
    stage_counts: Sequence[int],
    microbatches: int | None,
    schedule: str | None,
) -> PipelineChoice | None:
    """The fastest (stages, micro-batches, schedule, split) over ``stage_counts``; None when none applies."""
    found = pipeline_layers(model)
    if found is None or not found[0]:
        raise ValueError(
            f"pipeline stages go between repeated layers, and {type(model).__name__} has no nn.ModuleList of "
            "blocks of one class; compile it without pipeline= (or with a mesh without a 'pp' axis)"
        )
    container = found[0]
    batch = int(signature_of(inputs)[1][0].shape[0])
    schedules = (schedule,) if schedule else EXECUTABLE_SCHEDULES
    inner = dataclasses.replace(config, memory_budget=None, solve_recipes=False)
    best: tuple[float, PipelineChoice] | None = None
    for stages in stage_counts:
        sub_shape, sub_names = _sub_of(mesh, stages)
        submesh = _submesh(mesh.device_type, stages, sub_shape, sub_names)
        counts = [microbatches] if microbatches else [b for b in (stages * 2**i for i in range(6)) if batch % b == 0][:3]
        for b in counts:
            if batch % b:
                raise ValueError(f"microbatches={b} does not divide the global batch {batch}")
            _, gm, ctx = plan_graph(model, micro_call(inputs, b), submesh, cluster, inner, broadcast_solution=True)
            dev, f = cluster.device, config.optimizer_factor
            head, layers, tail = piece_costs(gm, ctx, container=container)  # each also steps its optimizer once
            head, tail = with_optimizer(head, dev, f), with_optimizer(tail, dev, f)
            layers = [with_optimizer(c, dev, f) for c in layers]
            # boundaries here are whole (Replicate): every device sends the whole activation, not its share
            k = math.prod(sub_shape)
            p2p = p2p_seconds(cluster, k, stages, boundary_bytes(gm, ctx) * k)
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


def micro_call(call: Any, parts: int) -> Any:
    """The first of ``parts`` micro-batches of a call (every tensor cut along dim 0), shaped like the call."""
    sig, tensors = signature_of(call)
    for name, t in zip(sig.names, tensors):
        if t.ndim == 0 or t.shape[0] % parts:
            raise ValueError(f"argument {name} of shape {tuple(t.shape)}: pipeline micro-batches cut every input "
                             f"along dim 0 into {parts}, which must divide it")
    args, kwargs = sig.unflatten([t[: t.shape[0] // parts] for t in tensors])
    return Call(args, kwargs) if kwargs else args


def _stage_constraints(config: PlanConfig, sig: Any, w: StageWiring, names: Sequence[str]) -> dict[str, Any]:
    """The user's constraints for one stage: parameter globs as given, a model input's constraint moved to the
    stage argument it feeds; received activations whole (Replicate)."""
    per_input = {"inputs", *(f"input[{i}]" for i in range(sig.num_tensors)), *sig.names}
    pins = {k: v for k, v in config.constraints.items() if k not in per_input}
    for pos, (kind, i) in enumerate(w.args):
        if kind == "recv":
            pins[f"input[{pos}]"] = [Replicate()] * len(names)
            continue
        for key in ("inputs", f"input[{i}]", sig.names[i]):
            if key in config.constraints:
                pins[f"input[{pos}]"] = config.constraints[key]
    return pins


def _canonical_names(model: nn.Module) -> dict[str, str]:
    """Every name of every parameter -> its first name (tied parameters have several)."""
    first: dict[int, str] = {}
    return {n: first.setdefault(id(p), n) for n, p in model.named_parameters(remove_duplicate=False)}


def compile_pipelined(
    model: nn.Module,
    mesh: DeviceMesh,
    inputs: Any,
    cluster: ClusterProfile,
    config: PlanConfig,
    backend: str,
    choice: PipelineChoice,
) -> PipelinedModule:
    from torch.distributed.pipelining import SplitPoint

    split = choice.split
    assert split is not None
    S, M = choice.stages, split.microbatches
    full = pp_mesh(mesh.device_type, S, choice.sub_shape, choice.sub_names)
    names = choice.sub_names
    submesh = full[tuple(names)] if len(names) > 1 else full[names[0]]
    k_sub = math.prod(choice.sub_shape)
    rank = dist.get_rank()
    pp_rank, local_index = divmod(rank, k_sub)
    sig, _ = signature_of(inputs)
    _, mb = signature_of(micro_call(inputs, M))
    spec = {f"{choice.container}.{start}": SplitPoint.BEGINNING for start, _ in split.layers[1:]}
    pipe, wiring = split_model(model, sig, mb, spec, config.loss_fn)
    n = pipe.num_stages
    ex_args, ex_sends = stage_examples(pipe, wiring, mb)
    canon = _canonical_names(model)
    placements: dict[str, str] = {}  # parameter (first name) -> layout of the first stage holding it
    holders: dict[str, list[int]] = {}
    stage_plans: list[Plan] = []
    stage_specs: list[Any] = []
    local: dict[int, StageModule] = {}
    for k in range(n):
        mod = pipe.get_stage_module(k)
        pnames = [p for p, _ in mod.named_parameters(remove_duplicate=False)]
        pins = _stage_constraints(config, sig, wiring[k], names)
        pins.update({p: placements[canon.get(p, p)] for p in pnames if canon.get(p, p) in placements})
        cfg = dataclasses.replace(config, constraints=pins, solve_recipes=False)
        plan, gm, ctx = plan_graph(mod, ex_args[k], submesh, cluster, cfg, broadcast_solution=True, stage=True)
        for p, pl in plan.parameter_placements().items():
            placements.setdefault(canon.get(p, p), pl)
        for p in dict.fromkeys(canon.get(p, p) for p in pnames):
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
            local[k] = StageModule(mod, submesh, plan, rank_program(gm, ctx, backend), grad_names, wiring[k])
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

    # what each stage receives and sends, as metadata for the schedule; received float activations need their
    # gradient, which pipelining reads off requires_grad
    def meta(ts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return tuple(t.detach().requires_grad_(t.requires_grad) for t in ts)

    stage_in = {k: meta(ex_sends[k - 1]) if k else () for k in local}
    stage_out = {k: meta(ex_sends[k]) for k in local}
    weighting = LossWeighting(*loss_counter(pipe.get_stage_module(n - 1), wiring[n - 1]))
    device = torch.device(mesh.device_type)
    return PipelinedModule(combined, local, n, full.get_group("pp"), pp_rank, stage_in, stage_out, sig, weighting,
                           tied, local_index, device, canon, frozenset(model.state_dict()))


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
