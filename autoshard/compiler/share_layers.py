"""share_layers: identical repeated layers share one set of decision variables.

Needs: ``coarsen`` (groups with module paths).

Guarantees on exit: ``ctx.layer_of_group`` maps every group id to its canonical group id (itself when not
shared). Layers are the numbered children of a container (``layers.0``, ``layers.1`` ... found from module
paths); a group belongs to the layer of its anchor's module. Two layers are identical when their groups, in
order, have the same kind, phase, module path relative to the layer, member ops and member shapes, and the same
weights frozen; then the i-th group of every such layer maps to the i-th group of the first one. A container
whose layers differ (e.g. a different width) is left unshared and logged. ``ctx.stats["shared_layers"]`` counts
layers folded away.

The solver gives shared groups one set of variables and multiplies their costs; strategies are computed
once per canonical group. When the planner captured only some of a container's layers
(``ctx.sampled_layers``), ``ctx.group_weight`` makes the captured middle layers stand for the missing ones.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch.fx as fx

from autoshard.compiler.capture_recompute import layer_modes, sampled_specs
from autoshard.compiler.context import PassContext
from autoshard.ir import is_frozen, layer_key

log = logging.getLogger(__name__)


def _signature(group, nodes: dict[str, fx.Node], prefix: str) -> tuple:
    rel = group.module[len(prefix) :]
    members = []
    for name in group.members:
        n = nodes[name]
        v = n.meta.get("val")
        shape = (
            tuple(v.shape)
            if hasattr(v, "shape")
            else tuple(tuple(x.shape) if hasattr(x, "shape") else None for x in (v or ()))
        )
        members.append(
            (
                n.op if n.op == "placeholder" else str(n.target),
                shape,
                n.meta.get("autoshard_follow"),
                n.meta.get("recompute"),  # a recomputed layer is not like one that saves
                is_frozen(n),
            )
        )  # nor a frozen weight like a trained one (it holds no gradient or state)
    return (group.kind, group.phase, rel, tuple(members))


def _weigh_sampled(ctx: PassContext, container: str, members: dict[int, list[int]], by_index: dict) -> None:
    """When only ``k`` of ``L`` identical layers were captured, the largest class of captured layers (the
    middle ones; the first and last may differ at their edges) stands for the ``L - k`` missing ones: each of
    its layers' groups weighs ``(n + L - k) / n``. When the layers recompute in different modes
    (``autoshard/compiler/capture_recompute.py: sampled_specs``), the missing layers of each mode are weighed onto the
    largest class of captured layers in that mode."""
    if ctx.sampled_layers is None or ctx.sampled_layers[0] != container:
        return
    _, k, total = ctx.sampled_layers
    captured_specs, counts = sampled_specs(ctx.config.recompute, container, k, total)
    captured = layer_modes(captured_specs, container, k)
    for mode in dict.fromkeys(captured):
        refs = [r for r in members if captured[r] == mode]
        missing = counts[mode] - captured.count(mode)
        if not refs or missing <= 0:
            continue
        ref = max(refs, key=lambda r: (len(members[r]), -abs(r - 1)))
        n = len(members[ref])
        w = (n + missing) / n
        for idx in members[ref]:
            for g in by_index[idx]:
                ctx.group_weight[g.id] = w
        log.info(
            "share_layers: %s: %d captured layers like layer %d (recompute %s) stand for %d (weight %.2f each)",
            container,
            n,
            ref,
            mode or "none",
            n + missing,
            w,
        )


def share_layers(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    canon = {g.id: g.id for g in ctx.groups}
    shared = 0
    if ctx.config.share_layers:
        nodes = {n.name: n for n in gm.graph.nodes}
        layers: dict[str, dict[int, list]] = defaultdict(lambda: defaultdict(list))
        for g in ctx.groups:
            key = layer_key(g.module)
            if key is not None:
                layers[key[0]][key[1]].append(g)
        for container, by_index in layers.items():
            indices = sorted(by_index)
            if len(indices) < 2:
                continue
            # layers fall into classes of identical structure (the first layer often differs: its input
            # needs no gradient); each class shares the variables of its first layer
            classes: dict[tuple, int] = {}
            members: dict[int, list[int]] = defaultdict(list)
            for idx in indices:
                sig = tuple(_signature(g, nodes, f"{container}.{idx}") for g in by_index[idx])
                ref = classes.setdefault(sig, idx)
                members[ref].append(idx)
                if ref == idx:
                    continue
                for g, r in zip(by_index[idx], by_index[ref]):
                    canon[g.id] = r.id
                shared += 1
            if len(classes) > 1:
                log.info("share_layers: %s has %d distinct layer structures", container, len(classes))
            _weigh_sampled(ctx, container, members, by_index)
    ctx.layer_of_group = canon
    ctx.stats["shared_layers"] = shared
    log.info("share_layers: %d layers share variables with an earlier identical layer", shared)
    return gm


def share_nothing(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """``share_layers``' stand-in when disabled: every group is its own canonical group (no shared variables)."""
    ctx.layer_of_group = {g.id: g.id for g in ctx.groups}
    ctx.stats["shared_layers"] = 0
    return gm
