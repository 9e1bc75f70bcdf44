"""Per-piece costs of a solved intra-op plan: what the inter-op stage DP (``solver.inter_op``) splits.

A model planned on a stage's sub-mesh at one micro-batch size is cut into pieces along its repeated layers:
the head piece (everything whose module runs before the first layer: embeddings, rotary tables), one piece per
layer (``layers.0`` ...), and the tail piece (final norm, output projection, loss). Each decision group goes to
the piece of its module; forward and backward of a module land in the same piece, as a pipeline stage runs
both. A group's cost is what the integer program charges it: its own compute, plus the collectives that feed
it (``plan_collectives``). Gradient reductions (a collective whose consumer is a parameter) run once per
step after all micro-batches, so they are the piece's ``step_s``, less the overlap credit the plan already
takes; everything else repeats per micro-batch. Two more numbers serve activation recomputation: ``fwd_s``,
the forward part of a piece's time (its forward groups' compute and the collectives feeding them), and
``input_bytes``, the per-device bytes of the activations entering the piece's forward from another piece (for a
layer: its input hidden state, in the layout its producer chose).

When only some layers were captured (``ctx.sampled_layers``), the missing ones are copies of the captured
layer that stands for them (the share_layers weights): the layer list has the full depth, and the pieces sum to
the plan's predicted step (tested). ``piece_detail`` also lists each piece's collectives on the mesh's outermost
axis, which the stage search prices again for sub-meshes of another size; the optimizer step
(:func:`optimizer_step_s`) joins each piece's once-per-step work, and :func:`boundary_node` is the activation a
stage boundary sends.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from autoshard.cluster.profile import DeviceSpec
from autoshard.compiler.context import PassContext
from autoshard.errors import InputError
from autoshard.ir import layer_key
from autoshard.solver.inter_op import PieceCost
from autoshard.solver.pricing import GRAD_SINK_CREDIT

if TYPE_CHECKING:
    from autoshard.solver.intra_op import Solution

HEAD, TAIL = "head", "tail"


def container_of(ctx: PassContext) -> str | None:
    """The repeated-layer container of a captured model (the sampled one, else the longest), or None."""
    if ctx.sampled_layers is not None:
        return ctx.sampled_layers[0]
    counts: dict[str, set[int]] = defaultdict(set)
    for g in ctx.groups:
        key = layer_key(g.module)
        if key is not None:
            counts[key[0]].add(key[1])
    return max(counts, key=lambda c: len(counts[c])) if counts else None


def _piece_of_modules(gm: fx.GraphModule, ctx: PassContext, container: str) -> tuple[dict[str, Any], int | None]:
    """Module path -> layer index or HEAD/TAIL, by where the module first runs in the forward; and the
    position of the first layer's first forward node."""
    order: dict[str, int] = {}
    first_layer = None
    group_of = {name: g for g in ctx.groups for name in g.members}
    for i, node in enumerate(gm.graph.nodes):
        g = group_of.get(node.name)
        if g is None or g.phase != "forward":
            continue
        order.setdefault(g.module, i)
        key = layer_key(g.module)
        if key is not None and key[0] == container and first_layer is None:
            first_layer = i
    out: dict[str, Any] = {}
    for module, pos in order.items():
        key = layer_key(module)
        if key is not None and key[0] == container:
            out[module] = key[1]
        else:
            out[module] = HEAD if first_layer is not None and pos < first_layer else TAIL
    return out, first_layer


def _input_bytes(gm: fx.GraphModule, ctx: PassContext, group_piece: dict[int, Any]) -> dict[Any, int]:
    """Per piece, the bytes one device holds of the activations that enter its forward from another piece (a
    layer's input hidden state), in the layout their producer chose: what activation recomputation keeps."""
    from autoshard.compiler.candidates import shard_factor

    ms = ctx.mesh_shape
    kinds = {g.id: g.kind for g in ctx.groups}
    seen: dict[Any, set[str]] = defaultdict(set)
    out: dict[Any, int] = defaultdict(int)
    for node in gm.graph.nodes:
        sh = node.meta.get("autoshard")
        if sh is None or node.op != "call_function" or node.meta.get("autoshard_phase") != "forward":
            continue
        piece = group_piece[sh.group]
        for src in node.all_input_nodes:
            src_sh = src.meta.get("autoshard")
            v = src.meta.get("val")
            if src_sh is None or not isinstance(v, torch.Tensor) or src.name in seen[piece]:
                continue
            if group_piece[src_sh.group] == piece or kinds[src_sh.group] in ("parameter", "buffer"):
                continue
            seen[piece].add(src.name)
            out[piece] += v.numel() * v.element_size() // shard_factor(src_sh.outputs[0], ms)
    return out


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


def boundary_node(gm: fx.GraphModule, ctx: PassContext) -> fx.Node | None:
    """The largest activation entering the first repeated layer from outside (what a stage boundary sends)."""
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


Outer = tuple[tuple[str, int, bool, bool, bool], ...]  # (kind, bytes, gradient reduction, forward, state)


def piece_costs(
    gm: fx.GraphModule, ctx: PassContext, solution: Solution | None = None, container: str | None = None
) -> tuple[PieceCost, list[PieceCost], PieceCost]:
    """(head, per-layer costs in order at full depth, tail) of ``solution`` (default ``ctx.solution``), which
    must be the one annotated onto ``gm``; the layers are those of ``container`` (default: ``container_of``)."""
    head, layers, tail, _ = piece_detail(gm, ctx, solution, container)
    return head, layers, tail


def piece_detail(
    gm: fx.GraphModule, ctx: PassContext, solution: Solution | None = None, container: str | None = None
) -> tuple[PieceCost, list[PieceCost], PieceCost, list[Outer]]:
    """:func:`piece_costs` and, per piece (head, layers, tail), the collectives on the mesh's outermost axis as
    (kind, bytes gathered, gradient reduction, forward, of a parameter or its gradient): what the stage search
    prices again for a sub-mesh whose outer axis has another size (``pipeline.search``)."""
    from autoshard.compiler.plan_collectives import plan_collectives  # the plan's own collective list: one accounting

    sol = solution if solution is not None else ctx.solution
    container = container or container_of(ctx)
    if container is None:
        raise InputError(
            "the model has no repeated layers (modules named like 'layers.0', 'h.1'): nothing to split "
            "into pipeline stages"
        )
    piece_of_module, first_layer = _piece_of_modules(gm, ctx, container)
    position = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    pieces: dict[Any, PieceCost] = defaultdict(lambda: PieceCost(0.0))

    def piece_of_group(g) -> Any:
        key = layer_key(g.module)
        if key is not None and key[0] == container:
            return key[1]
        if g.module == "" and g.phase == "forward" and first_layer is not None:
            # the root's own ops: table lookups before the layers (rotary slices) vs the loss after them
            return HEAD if position[g.anchor] < first_layer else TAIL
        if g.module in piece_of_module:
            return piece_of_module[g.module]
        # modules seen only in backward (or the root: the loss and its gradient): the tail, which runs the
        # backward first; parameters and inputs of the root belong to the head
        return HEAD if g.kind in ("parameter", "buffer", "input") else TAIL

    group_piece = {g.id: piece_of_group(g) for g in ctx.groups}
    for g in ctx.groups:
        s = ctx.strategies[g.id][sol.choice[g.id]]
        fwd = s.compute_s if g.phase == "forward" else 0.0
        pieces[group_piece[g.id]] += PieceCost(s.compute_s, 0.0, s.state_bytes, s.activation_bytes, fwd)
    node_group = {n.name: n.meta["autoshard"].group for n in gm.graph.nodes if "autoshard" in n.meta}
    params = {n.meta["autoshard_role"].name: n.name for n in gm.graph.find_nodes(op="placeholder")}
    kinds = {g.id: g.kind for g in ctx.groups}
    outer: dict[Any, list] = defaultdict(list)
    for c in plan_collectives(gm, ctx):
        fwd = c.time_s if c.phase == "forward" else 0.0
        grad = c.consumer in ctx.param_modules
        if grad:  # a gradient reduction: once per step, partly hidden
            piece = group_piece[node_group[params[c.consumer]]]
            pieces[piece] += PieceCost(0.0, c.time_s * (1.0 - GRAD_SINK_CREDIT))
        elif c.phase == "optimizer":  # a ZeRO-1/2 master gathered back after the step: once per step, not hidden
            piece = group_piece[node_group[c.tensor]] if c.tensor in node_group else HEAD  # (a bundle's latency)
            pieces[piece] += PieceCost(0.0, c.time_s)
        else:
            piece = TAIL if c.consumer == "output" else group_piece[node_group[c.consumer]]
            pieces[piece] += PieceCost(c.time_s, fwd_s=fwd)
        if c.axis == ctx.mesh_names[0]:
            state = (
                grad
                or kinds.get(node_group.get(c.tensor, -1)) in ("parameter", "buffer")
                or c.tensor.startswith("group of")
            )
            outer[piece].append((c.kind, c.nbytes, grad, c.phase == "forward", state))
    for piece, nbytes in _input_bytes(gm, ctx, group_piece).items():
        pieces[piece] += PieceCost(0.0, input_bytes=nbytes)
    captured = sorted(k for k in pieces if isinstance(k, int))
    order = captured
    if ctx.sampled_layers is not None:
        _, k, total = ctx.sampled_layers
        weights = {
            group_piece[g.id]: w
            for g, w in ((g, ctx.group_weight.get(g.id, 1.0)) for g in ctx.groups)
            if isinstance(group_piece[g.id], int) and w != 1.0
        }
        ref = next(iter(weights), captured[len(captured) // 2])
        # the missing layers sit between the captured first ones and the captured last one
        at = captured.index(ref) + 1
        order = captured[:at] + [ref] * (total - k) + captured[at:]
    detail = [tuple(outer[p]) for p in (HEAD, *order, TAIL)]
    return pieces[HEAD], [pieces[k] for k in order], pieces[TAIL], detail


__all__ = ["Outer", "boundary_node", "optimizer_step_s", "piece_costs", "piece_detail", "with_optimizer"]
