"""``autoshard.compile`` with pipeline stages: choose the split, cut the model, plan and compile every stage.

The mesh this runs on has a ``pp`` axis outermost (the user's, or one made from the outermost axis by
``pipeline="auto"``): ``pp`` copies of a stage sub-mesh, rank-major (stage s holds global ranks s*k .. s*k+k-1).

1. Choose: the stage search offline plans use (``pipeline.search.search_stages``) over the stage counts and
   micro-batch counts, on the real ``pp`` sub-meshes (every rank plans the same things; rank 0's solutions are
   broadcast), with what differs here: boundaries sent whole (each device sends the whole activation), only the
   schedules that run here (``runtime.pipelined.EXECUTABLE_SCHEDULES``), no recomputation and no recipe layouts
   (each stage is planned freely below). ``pipeline="auto"`` also weighs no pipeline at all (the plain plan of
   the whole batch on the whole mesh).
2. Cut: ``torch.distributed.pipelining.pipeline`` splits the module at the chosen layers (``SplitPoint``).
3. Plan and compile: each stage is planned on the sub-mesh (``plan_graph(stage=True)``) with its received
   activations whole (Replicate) and a parameter shared with an earlier stage pinned to that stage's layout, so
   its gradient copies can be summed shard by shard; this rank's stages are compiled (``CompiledProgram``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.placement_types import Placement

from autoshard.cluster.profile import ClusterProfile
from autoshard.compiler.runner import rank_program
from autoshard.config import PlanConfig
from autoshard.inputs import signature_of
from autoshard.pipeline.blocks import main_sequence, no_sequence_error, outside_part
from autoshard.pipeline.pricing import SearchSpace
from autoshard.pipeline.search import search_stages
from autoshard.pipeline.solves import KeyCosts, StageSolves, micro_call
from autoshard.pipeline.wiring import loss_counter, split_model, stage_examples
from autoshard.plans.plan import MeshSpec, Plan
from autoshard.runtime.pipelined import EXECUTABLE_SCHEDULES, LossWeighting, PipelinedModule, TiedParameter
from autoshard.runtime.stage_module import StageModule
from autoshard.runtime.stage_values import StageWiring
from autoshard.search.recompute import plan_graph
from autoshard.solver.inter_op import SPLIT_BACKWARD, StageSplit

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


class RealStageMeshes:
    """The stage search's sub-meshes on the real process group: ``pp`` copies of a sub-mesh of ``mesh`` (made
    once per stage count, on every rank in the same order), priced on ``cluster`` as it is."""

    broadcast = True

    def __init__(self, mesh: DeviceMesh, cluster: ClusterProfile) -> None:
        self.device_type, self.full = mesh.device_type, cluster
        self.made: dict[int, DeviceMesh] = {}

    @contextlib.contextmanager
    def mesh(self, stages: int, shape: tuple[int, ...], names: tuple[str, ...]) -> Iterator[DeviceMesh]:
        if stages not in self.made:
            self.made[stages] = _submesh(self.device_type, stages, shape, names)
        yield self.made[stages]

    def cluster(self, world: int) -> ClusterProfile:
        return self.full


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
    """The fastest (stages, micro-batches, schedule, split) over ``stage_counts`` the stage search found (only
    configurations it solved, with schedules this runtime runs); None when none fits."""
    found = main_sequence(model)
    if found is None:
        raise no_sequence_error(model, "compile it without pipeline= (or with a mesh without a 'pp' axis)")
    container = found[0]
    solves = StageSolves(model, inputs, config, RealStageMeshes(mesh, cluster), container)
    # boundaries here are whole (Replicate): every device sends the whole activation, not its share
    space = SearchSpace(
        boundary="whole",
        schedules=(schedule,) if schedule else EXECUTABLE_SCHEDULES,
        microbatches=microbatches,
        recompute=False,
        fallback=(),
        polish=False,
    )
    rungs = [(s, *_sub_of(mesh, s)) for s in stage_counts]
    options = search_stages(model, inputs, cluster, config, rungs, space, solves)
    best = next((o for o in options if not o.estimated and o.split is not None), None)
    if best is None or best.costs is None:
        return None
    return PipelineChoice(
        best.stages, best.submesh, best.names, best.split, container, _stage_times(best.split, best.costs, best.p2p_s)
    )


def _stage_times(split: StageSplit, kc: KeyCosts, p2p: float) -> tuple[float, ...]:
    """Each stage's (chunk's) time per micro-batch: its layers, the head / tail on the first / last, and one
    send each way per boundary it touches."""
    n = len(split.layers)
    return tuple(
        sum(c.time_s for c in kc.layers[a:b])
        + (kc.head.time_s if k == 0 else 0.0)
        + (kc.tail.time_s if k == n - 1 else 0.0)
        + 2 * p2p * ((k > 0) + (k < n - 1))
        for k, (a, b) in enumerate(split.layers)
    )


def _submesh(device_type: str, stages: int, sub_shape: Sequence[int], sub_names: Sequence[str]) -> DeviceMesh:
    mesh = pp_mesh(device_type, stages, sub_shape, sub_names)
    return mesh[tuple(sub_names)] if len(sub_names) > 1 else mesh[sub_names[0]]


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
    low = (
        getattr(torch, config.mixed_precision)
        if config.mixed_precision and config.precision_policy == "params"
        else None
    )
    pipe, wiring = split_model(model, sig, mb, spec, config.loss_fn, low)
    n = pipe.num_stages
    ex_args, ex_sends = stage_examples(pipe, wiring, mb, low)
    canon = _canonical_names(model)
    placements: dict[str, tuple[Placement, ...]] = {}  # parameter (first name) -> its first holder's layout
    holders: dict[str, list[int]] = {}
    stage_plans: list[Plan] = []
    stage_specs: list[Any] = []
    local: dict[int, StageModule] = {}
    for k in range(n):
        mod = pipe.get_stage_module(k)
        pnames = [p for p, _ in mod.named_parameters(remove_duplicate=False)]
        pins = _stage_constraints(config, sig, wiring[k], names)
        pins.update({p: placements[canon.get(p, p)] for p in pnames if canon.get(p, p) in placements})
        # a parameter tied across stages is pinned to its first holder's compute layout, and its copies' gradients
        # are summed across stages: their master layouts must match too, so tied models keep masters unsharded
        cfg = dataclasses.replace(
            config,
            constraints=pins,
            solve_recipes=False,
            shard_state=config.shard_state and len(set(canon.values())) == len(canon),
        )
        planned = plan_graph(mod, ex_args[k], submesh, cluster, cfg, broadcast_solution=True, stage=True)
        plan, gm, ctx = planned.plan, planned.graph, planned.ctx
        for node in gm.graph.find_nodes(op="placeholder"):  # the solved layouts, as Placement objects
            role = node.meta["autoshard_role"]
            if role.kind == "parameter":
                placements.setdefault(canon.get(role.name, role.name), tuple(node.meta["autoshard"].outputs[0]))
        for p in dict.fromkeys(canon.get(p, p) for p in pnames):
            holders.setdefault(p, []).append(k)
        start, stop = split.layers[k]
        # the stage's modules outside the repeated layers (embeddings first on stage 0, the head last)
        extra = list(
            dict.fromkeys(
                outside_part(p.rpartition(".")[0], choice.container)
                for p in pnames
                if not p.startswith(choice.container + ".")
            )
        )
        body = [f"{choice.container}.{i}" for i in range(start, stop)]
        layers = tuple(extra + body if k == 0 else body + extra)
        ranks = tuple(range((k % S) * k_sub, (k % S + 1) * k_sub))
        stage_plans.append(plan)
        stage_specs.append(
            dataclasses.replace(
                plan.stages[0], index=k, ranks=ranks, layers=layers, microbatch_time_s=choice.stage_times[k]
            )
        )
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
        mixed_precision=stage_plans[0].mixed_precision,
        reduce_dtype=stage_plans[0].reduce_dtype,
        precision_policy=stage_plans[0].precision_policy,
    )

    # what each stage receives and sends, as metadata for the schedule; received float activations need their
    # gradient, which pipelining reads off requires_grad
    def meta(ts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return tuple(t.detach().requires_grad_(t.requires_grad) for t in ts)

    stage_in = {k: meta(ex_sends[k - 1]) if k else () for k in local}
    stage_out = {k: meta(ex_sends[k]) for k in local}
    weighting = LossWeighting(*loss_counter(pipe.get_stage_module(n - 1), wiring[n - 1]))
    device = torch.device(mesh.device_type)
    return PipelinedModule(
        combined,
        local,
        n,
        full.get_group("pp"),
        pp_rank,
        stage_in,
        stage_out,
        sig,
        weighting,
        tied,
        local_index,
        device,
        canon,
        frozenset(model.state_dict()),
        tree=model,
        split_backward=combined.schedule in SPLIT_BACKWARD,
    )


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


__all__ = ["PipelineChoice", "RealStageMeshes", "choose_pipeline", "compile_pipelined", "pp_mesh"]
