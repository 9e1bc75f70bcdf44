"""A pipelined Plan: the chosen pipeline configuration as one :class:`StagePlan` per stage.

The stage search (``autoshard.pipeline.search``) compares stage counts, micro-batch counts and schedules and
returns each option's split (layer ranges, time per micro-batch and memory per stage). This module takes the
winning option's stage plan from the search's solves (``pipeline.solves``: the sub-mesh's plan at the
micro-batch size, or the recipe it fell back to; solved anew when no solves are handed over) and cuts it into
stages:

- a stage's ``layers`` are its layer ranges (every chunk of an interleaved schedule, in order), with the
  modules that run before the repeated layers (embeddings) first on stage 0 and those after them (final norm,
  output head) last on the last stage;
- its tensors, op decisions and collectives are those of its pieces. When only some layers were captured
  (``sample_layers``), a missing layer is a copy of the captured layer that stands for it, renamed
  (``layers.1.attn.wq.weight`` -> ``layers.7.attn.wq.weight``) so that a stage lists the real model's names.
  A tensor is listed on every stage that uses it in forward (a tied output head lists the embedding weight on
  the last stage too);
- collectives count per step: per-micro-batch ones ``microbatches`` times, gradient reductions once, plus the
  boundary sends (``send_recv`` on the ``pp`` axis, forward activation and backward gradient);
- its time per micro-batch and its memory (training state plus in-flight micro-batch activations) are the
  split's; the state splits into parameters, gradients and optimizer state in the proportions of the stage's
  strategies, and ``compute_s + comm_s`` is the stage's busy time per step.

Ranks: the mesh is ``pp`` x sub-mesh with ``pp`` outermost, so stage s holds ranks s*k ... s*k + k - 1.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

from autoshard.cluster.meshes import mesh_names
from autoshard.cluster.profile import ClusterProfile
from autoshard.config import PlanConfig
from autoshard.errors import InputError
from autoshard.ir import layer_key
from autoshard.notation import format_bytes, format_seconds
from autoshard.pipeline.blocks import outside_part
from autoshard.pipeline.costs import container_of, optimizer_step_s, piece_costs
from autoshard.pipeline.pricing import PipelineOption
from autoshard.pipeline.solves import FREE, FakeStageMeshes, StageSolves
from autoshard.plans.plan import CollectiveStat, LayerTime, MemoryBreakdown, MeshSpec, Plan, StagePlan, block_of
from autoshard.solver.inter_op import PieceCost

if TYPE_CHECKING:
    import torch.fx as fx

    from autoshard.compiler.context import PassContext
    from autoshard.solver.intra_op import Solution

log = logging.getLogger(__name__)

HEAD, TAIL = "head", "tail"
Piece = str | int  # HEAD, TAIL, or a captured layer index
TENSOR_KINDS = ("parameter", "buffer", "input")
FLAT_NAME = "1 stage (no pipeline)"


@dataclasses.dataclass(frozen=True)
class _Cut:
    """The sub-mesh plan cut into pieces: what each piece lists, and which captured layer stands for each layer."""

    container: str  # the repeated layers' module path ("layers")
    full: tuple[int, ...]  # layer i of the full depth -> the captured layer that stands for it
    tensors: dict[Piece, list[Any]]
    ops: dict[Piece, list[Any]]
    collectives: dict[Piece, list[CollectiveStat]]
    state: dict[Piece, tuple[float, float, float]]  # parameter, gradient, optimizer bytes per device
    modules: dict[Piece, list[str]]  # top-level modules of the head and tail pieces, in forward order
    params: frozenset[str]


def _container(ctx: PassContext) -> str:
    found = container_of(ctx)
    if found is None:
        raise InputError("the model has no repeated layers (modules named like 'layers.0'): nothing to pipeline")
    return found


def _cut(gm: fx.GraphModule, ctx: PassContext, sub: Plan, solution: Solution, container: str) -> _Cut:
    """Assign the sub-mesh plan's tensors, decisions and collectives to head / captured layer / tail pieces
    (layers of ``container``, the main sequence the search split; when empty, the captured one)."""

    container = container or _container(ctx)
    nodes = {n.name: n for n in gm.graph.nodes}
    position = {name: i for i, name in enumerate(nodes)}
    group_of = {m: g for g in ctx.groups for m in g.members}

    def layer(module: str) -> int | None:
        key = layer_key(module)
        return key[1] if key is not None and key[0] == container else None

    fwd = [g for g in ctx.groups if g.phase == "forward" and g.kind not in TENSOR_KINDS]
    first_layer = min((position[g.anchor] for g in fwd if layer(g.module) is not None), default=math.inf)
    module_at: dict[str, int] = {}
    for g in fwd:
        module_at[g.module] = min(module_at.get(g.module, math.inf), position[g.anchor])

    def piece(g: Any) -> Piece:
        if (i := layer(g.module)) is not None:
            return i
        at = position[g.anchor] if g.module == "" and g.kind not in TENSOR_KINDS else module_at.get(g.module)
        if at is None:  # only in backward (the loss's gradient): the last stage runs the backward first
            return HEAD if g.kind in TENSOR_KINDS and g.phase == "forward" else TAIL
        return HEAD if at < first_layer else TAIL

    group_piece = {g.id: piece(g) for g in ctx.groups}

    def tensor_pieces(g: Any) -> list[Piece]:
        """Its own piece and every piece with a forward op that reads it (followers included)."""
        found = [group_piece[g.id]] if g.module else []
        for m in g.members:
            for u in nodes[m].users:
                user = group_of.get(u.name)
                if (
                    user is not None
                    and user.id != g.id
                    and user.phase == "forward"
                    and group_piece[user.id] not in found
                ):
                    found.append(group_piece[user.id])
        return found or [group_piece[g.id]]

    if len(sub.stages) != 1:
        raise InputError(f"a stage's plan has {len(sub.stages)} stages")
    stage = sub.stages[0]
    tensor_group = {
        n.meta["autoshard_role"].name: group_of[n.name]
        for n in gm.graph.find_nodes(op="placeholder")
        if n.name in group_of
    }
    tensors: dict[Piece, list[Any]] = defaultdict(list)
    for t in stage.tensors:
        for p in tensor_pieces(tensor_group[t.name]):
            tensors[p].append(t)
    anchor_group = {g.anchor: g for g in ctx.groups}
    ops: dict[Piece, list[Any]] = defaultdict(list)
    for d in stage.ops:
        ops[group_piece[anchor_group[d.node].id]].append(d)
    params = frozenset(t.name for t in stage.tensors if t.role == "parameter")
    collectives: dict[Piece, list[CollectiveStat]] = defaultdict(list)
    for c in stage.collectives:
        if c.consumer == "output":
            p: Piece = TAIL
        elif c.consumer in tensor_group:
            p = group_piece[tensor_group[c.consumer].id]
        else:
            p = group_piece[group_of[c.consumer].id]
        collectives[p].append(c)
    state: dict[Piece, tuple[float, float, float]] = defaultdict(lambda: (0.0, 0.0, 0.0))
    for g in ctx.groups:
        s = ctx.strategies[g.id][solution.choice[g.id]]
        a, b, c = state[group_piece[g.id]]
        state[group_piece[g.id]] = (a + s.param_bytes, b + s.grad_bytes, c + s.optimizer_bytes)
    modules: dict[Piece, list[str]] = {HEAD: [], TAIL: []}
    for g in sorted(fwd, key=lambda g: position[g.anchor]):
        top = outside_part(g.module, container)
        p = group_piece[g.id]
        # (a module the sequence is inside, JambaModel's own mask ops, is glue: not listed)
        if g.module and not (container + ".").startswith(top + ".") and p in modules and top not in modules[p]:
            modules[p].append(top)
    captured = sorted({p for p in group_piece.values() if isinstance(p, int)})
    full = captured
    if ctx.sampled_layers is not None:
        # as pipeline_costs extrapolates: the missing layers are copies of the first weighted (shared) layer
        # and sit right after it
        _, k, total = ctx.sampled_layers
        weighted = [
            group_piece[g.id]
            for g in ctx.groups
            if ctx.group_weight.get(g.id, 1.0) != 1.0 and isinstance(group_piece[g.id], int)
        ]
        ref = weighted[0] if weighted else captured[len(captured) // 2]
        at = captured.index(ref) + 1
        full = captured[:at] + [ref] * (total - k) + captured[at:]
    return _Cut(container, tuple(full), tensors, ops, collectives, state, modules, params)


def _renamer(container: str, captured: int, layer: int) -> Callable[[str], str]:
    old, new = f"{container}.{captured}", f"{container}.{layer}"

    def rename(name: str) -> str:
        if name == old or name.startswith(old + "."):
            return new + name[len(old) :]
        return name

    return rename


def _rank_pieces(option: PipelineOption, rank: int) -> list[tuple[int, int]]:
    """The layer ranges rank ``rank`` runs: chunk k of the split is on rank k mod stages."""
    assert option.split is not None
    return [r for k, r in enumerate(option.split.layers) if k % option.stages == rank]


def _stage(
    option: PipelineOption,
    rank: int,
    cut: _Cut,
    costs: tuple[PieceCost, list[PieceCost], PieceCost],
    mesh: MeshSpec,
    axis_of: dict[str, str],
    cluster: ClusterProfile,
    optimizer_factor: int,
) -> StagePlan:
    split = option.split
    assert split is not None
    last = rank == option.stages - 1
    b = split.microbatches
    head, layer_costs, tail = costs
    layers = [i for lo, hi in _rank_pieces(option, rank) for i in range(lo, hi)]
    pieces: list[tuple[Piece, Callable[[str], str]]] = [(HEAD, str)] if rank == 0 else []
    pieces += [(cut.full[i], _renamer(cut.container, cut.full[i], i)) for i in layers]
    pieces += [(TAIL, str)] if last else []
    tensors: dict[str, Any] = {}
    ops, collectives = [], []
    per_mb: dict[tuple[str, str], float] = defaultdict(float)  # (block, phase) -> activation collectives a micro-batch
    param = grad = opt = 0.0
    for p, rename in pieces:
        for t in cut.tensors.get(p, ()):
            tensors.setdefault(rename(t.name), dataclasses.replace(t, name=rename(t.name)))
        ops += [dataclasses.replace(d, module=rename(d.module)) for d in cut.ops.get(p, ())]
        for c in cut.collectives.get(p, ()):
            once = c.consumer in cut.params  # a gradient reduction runs once per step, after the micro-batches
            collectives.append(
                dataclasses.replace(
                    c,
                    axis=axis_of.get(c.axis, c.axis),
                    consumer=rename(c.consumer),
                    owner=rename(c.owner),
                    repeat=1.0 if once else float(b),
                )
            )
            if not once:
                per_mb[(block_of(rename(c.owner)), c.phase)] += c.time_s
        a, g, o = cut.state.get(p, (0.0, 0.0, 0.0))
        param, grad, opt = param + a, grad + g, opt + o
    own = ([head] if rank == 0 else []) + [layer_costs[i] for i in layers] + ([tail] if last else [])
    t = split.stage_time_s[rank]
    # the split's time per micro-batch: the pieces (layers' forward again under recomputation) plus two boundary
    # sends per chunk the rank holds
    chunks = len(_rank_pieces(option, rank))
    work = sum(c.time_s for c in own) + (sum(layer_costs[i].fwd_s for i in layers) if split.recompute else 0.0)
    sends = 2 * chunks if option.stages > 1 else 0
    send = max(0.0, (t - work) / sends) if sends else 0.0
    if sends:
        link = cluster.inter_node if cluster.nodes > 1 else cluster.intra_node
        nbytes = int(max(0.0, send - link.latency) * link.bandwidth)
        for phase, peer in (("forward", rank + 1), ("backward", rank - 1)):
            collectives.append(
                CollectiveStat(
                    "send_recv",
                    "pp",
                    nbytes,
                    send,
                    "stage boundary",
                    f"stage {peer % option.stages}",
                    phase,
                    float(b * chunks),
                )
            )
    state = sum(c.state_bytes for c in own)
    update_s = optimizer_step_s(state, cluster.device, optimizer_factor)
    once = sum(c.step_s for c in own) + update_s
    # (a copied layer's gradient reductions, renamed, are once a step: in ``once``, not per micro-batch)
    comm = b * (sum(per_mb.values()) + send * sends) + once
    busy = b * t + once
    total = split.stage_memory_bytes[rank]
    parts = param + grad + opt
    params_b = int(round(state * param / parts)) if parts else 0
    grads_b = int(round(state * grad / parts)) if parts else 0
    memory = MemoryBreakdown(params_b, grads_b, state - params_b - grads_b, max(0, total - state))
    names = [n for n in cut.modules[HEAD]] if rank == 0 else []
    names += [f"{cut.container}.{i}" for i in layers] + (list(cut.modules[TAIL]) if last else [])
    k = mesh.size
    log.info(
        "pipeline stage %d: ranks %d-%d, %s ... %s, %s per micro-batch, %s per device",
        rank,
        rank * k,
        rank * k + k - 1,
        names[0],
        names[-1],
        format_seconds(t),
        format_bytes(memory.total),
    )
    return StagePlan(
        index=rank,
        mesh=mesh,
        ranks=tuple(range(rank * k, rank * k + k)),
        layers=tuple(names),
        tensors=tuple(tensors.values()),
        ops=tuple(ops),
        collectives=tuple(collectives),
        memory=memory,
        compute_s=max(0.0, busy - comm),
        comm_s=min(comm, busy),
        microbatch_time_s=t,
        layer_times=_rows(names, own, per_mb, b, split.recompute, (send * sends, update_s), rank == 0, last),
    )


def _rows(
    names: list[str],
    own: list[PieceCost],
    comm: dict[tuple[str, str], float],
    b: int,
    recompute: bool,
    extra: tuple[float, float],
    first: bool,
    last: bool,
) -> tuple[LayerTime, ...]:
    """The stage's step per block, from the costs its time is made of: each piece's forward and backward per
    micro-batch (its forward again under recomputation) and its once-a-step work, the boundary sends of each
    micro-batch and the optimizer update; of each piece's time, the activation collectives it waits for."""
    labels = (["before the layers"] if first else []) + [n for n in names if layer_key(n)]
    labels += ["after the layers"] if last else []
    rows = []
    for label, c in zip(labels, own):
        block = block_of(label) if layer_key(label) else "outside the layers"
        back = c.time_s - c.fwd_s
        fc, bc = min(c.fwd_s, comm.get((block, "forward"), 0.0)), min(back, comm.get((block, "backward"), 0.0))
        rows.append(LayerTime(label, c.fwd_s, back, b, c.step_s, fc, bc, c.fwd_s if recompute else 0.0))
    sends, update = extra
    if sends:
        rows.append(LayerTime("stage boundary sends", sends / 2, sends / 2, b, 0.0, sends / 2, sends / 2))
    rows.append(LayerTime("optimizer step", 0.0, 0.0, b, update))
    return tuple(rows)


def pipelined_plan(
    model: nn.Module,
    example_inputs: Sequence[Any],
    cluster: ClusterProfile,
    config: PlanConfig,
    option: PipelineOption,
    axis_names: Sequence[str] | None = None,
    solves: StageSolves | None = None,
) -> Plan:
    """The Plan of ``option`` (a stage search result with a split): one StagePlan per stage on a mesh ``pp`` x
    ``option.submesh``; ``axis_names`` names the sub-mesh axes (default ``meshes.mesh_names``). ``solves``: the
    search's solves, whose stage plan is taken as the search costed it (without them it is solved again)."""
    from autoshard.search.planned import build_plan

    split = option.split
    if split is None:
        raise InputError(f"{option.stages} stages of {option.submesh}: {option.note or 'no split'}; nothing to plan")
    sub_shape = tuple(option.submesh)
    default = mesh_names(sub_shape)
    names = tuple(axis_names) if axis_names is not None else default
    if len(names) != len(sub_shape) or "pp" in names:
        raise InputError(f"axis names {names} for sub-mesh {sub_shape}: give one name per axis, none of them 'pp'")
    if solves is None:
        from autoshard.pipeline.blocks import main_sequence

        solves = StageSolves(
            model,
            example_inputs,
            config,
            FakeStageMeshes(cluster),
            (main_sequence(model) or ("",))[0],
            reuse=False,
            strict_inputs=False,
        )
    # the stage layout the search costed: the free intra-op plan, or the recipe it fell back to when the free
    # plan's stages did not fit (option.recipe)
    label = FREE if option.recipe == (config.recipe or "") else option.recipe
    gm, ctx, sol = solves.graph(option.stages, (sub_shape, default, split.microbatches), label)
    sub = build_plan(gm, ctx, sol, recipe=option.recipe)
    costs = piece_costs(gm, ctx, sol, container=solves.container)
    cut = _cut(gm, ctx, sub, sol, solves.container)
    depth = split.layers[-1][1] if split.layers else 0
    if len(cut.full) != depth or len(costs[1]) != depth:
        raise InputError(f"the re-planned sub-mesh has {len(cut.full)} layers but the split covers {depth}")
    mesh = MeshSpec(sub_shape, names)
    axis_of = dict(zip(default, names))
    stages = tuple(
        _stage(option, r, cut, costs, mesh, axis_of, cluster, config.optimizer_factor) for r in range(option.stages)
    )
    return Plan(
        mesh=MeshSpec((option.stages, *sub_shape), ("pp", *names)) if option.stages > 1 else mesh,
        cluster=cluster.name,
        stages=stages,
        step_time_s=split.step_time_s,
        solver=sub.solver,
        schedule=split.schedule,
        microbatches=split.microbatches,
        chunks=split.chunks,
        bubble_fraction=split.bubble_fraction,
        recompute=split.recompute,
        memory_budget_bytes=int(config.memory_budget or 0),
        **config.precision_fields,
        sampled_layers=sub.sampled_layers,
        recipe=option.recipe,
    )


__all__ = ["FLAT_NAME", "pipelined_plan"]
