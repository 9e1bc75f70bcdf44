"""coarsen: put nodes that can only follow their producer into the producer's decision group.

Needs: the captured joint graph (``capture``): ``meta["val"]`` on every node, roles on placeholders.

Guarantees on exit:
- ``ctx.groups`` is a list of ``Group`` in topological order of their anchors; every placeholder and call node
  is a member of exactly one group (``node.meta["autoshard_group"]`` = group id);
- getitem, view-like, alias/copy and pointwise ops are followers: they join the group of one tensor input
  (``node.meta["autoshard_follow"]`` = the index of that input among the node's tensor args), chosen as the
  input with the output's shape whose producer is not a placeholder, else the first;
- placeholders each start their own group (so a parameter and the ``t``/views of it form one group);
- nodes with no tensor input (factories: arange, full, scalar_tensor ...) and constants the model made
  (``get_attr`` of a ``torch.tensor(...)``) form their own "factory" groups;
- everything else (matmuls, attention, embedding, norms, reductions, losses) anchors a new "op" group.

Before:  mm -> view -> add(., bias) -> relu ; layer_norm -> getitem
After:   group(mm: [mm, view, add, relu]) ; group(layer_norm: [layer_norm, getitem])
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx

from autoshard import _torch_compat as tc
from autoshard.compiler.context import PassContext
from autoshard.ir import Group, layer_key, tensor_args
from autoshard.rules.random_draws import is_draw

log = logging.getLogger(__name__)
aten = torch.ops.aten

# Ops whose output layout is a function of one input's layout and that cost little: views, aliases, copies.
VIEW_LIKE = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.t.default,
    aten.transpose.int,
    aten.permute.default,
    aten.expand.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.clone.default,
    aten._to_copy.default,
    aten.detach.default,
    aten.alias.default,
    aten.contiguous.default,
    aten.slice.Tensor,
    aten.select.int,
    aten.lift_fresh_copy.default,
    aten.view_as.default,
}


def is_follower(node: fx.Node) -> bool:
    if node.target is operator.getitem:
        return True
    if not isinstance(node.target, tc.OpOverload):
        return False
    if node.target in VIEW_LIKE:
        return True
    if torch.Tag.pointwise in node.target.tags:
        return isinstance(node.meta.get("val"), torch.Tensor)
    return False


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a.split("."), b.split(".")):
        if x != y:
            break
        n += 1
    return n


def choose_followed(node: fx.Node, ins: list[fx.Node]) -> int:
    """The input whose group the follower joins: same shape as the output, produced in the nearest module
    (so a residual add joins its own layer's stream, not the previous layer's), not a placeholder."""
    val = node.meta.get("val")
    shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
    module = node.meta.get("autoshard_module", "")
    ranked = sorted(
        range(len(ins)),
        key=lambda i: (
            tuple(ins[i].meta["val"].shape) != shape,
            -_common_prefix(module, ins[i].meta.get("autoshard_module", "")),
            ins[i].op == "placeholder",
            ins[i].meta.get("autoshard_kind") == "factory",
            i,
        ),
    )
    return ranked[0]


def coarsen(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    return _coarsen(gm, ctx, follow=True)


def coarsen_per_node(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """``coarsen``'s stand-in when disabled: every node decides alone (only a multi-output op's getitems
    follow it), so the solver has one variable per op."""
    return _coarsen(gm, ctx, follow=False)


def _coarsen(gm: fx.GraphModule, ctx: PassContext, follow: bool) -> fx.GraphModule:
    members: dict[int, list[str]] = {}
    info: dict[int, tuple[str, str, str, str]] = {}  # id -> anchor, kind, module, phase

    def new_group(node: fx.Node, kind: str) -> None:
        gid = len(members)
        members[gid] = [node.name]
        info[gid] = (
            node.name,
            kind,
            node.meta.get("autoshard_module", ""),
            node.meta.get("autoshard_phase", "forward"),
        )
        node.meta["autoshard_group"] = gid
        node.meta["autoshard_kind"] = kind

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            new_group(node, node.meta["autoshard_role"].kind)
            continue
        if node.op == "get_attr":  # a constant tensor the model made (torch.tensor(...)): replicated, like a factory
            node.meta.setdefault("autoshard_module", "")
            node.meta.setdefault("autoshard_phase", "forward")
            new_group(node, "factory")
            continue
        if node.op != "call_function":
            continue
        ins = tensor_args(node)
        if node.target is operator.getitem:
            producer = node.args[0]
            gid = producer.meta["autoshard_group"]
            members[gid].append(node.name)
            node.meta["autoshard_group"] = gid
            node.meta["autoshard_follow"] = 0
            node.meta["autoshard_kind"] = producer.meta["autoshard_kind"]
            continue
        if not ins and not is_draw(node):  # (a random draw is placed: each rank keeps its piece)
            new_group(node, "factory")
            continue
        k = choose_followed(node, ins) if follow and is_follower(node) else -1
        # groups never cross a repeated-layer boundary, so identical layers keep identical groups
        if k >= 0 and layer_key(node.meta.get("autoshard_module", "")) == layer_key(
            info[ins[k].meta["autoshard_group"]][2]
        ):
            gid = ins[k].meta["autoshard_group"]
            members[gid].append(node.name)
            node.meta["autoshard_group"] = gid
            node.meta["autoshard_follow"] = k
            node.meta["autoshard_kind"] = ins[k].meta["autoshard_kind"]
            continue
        new_group(node, "op")

    ctx.groups = [
        Group(gid, info[gid][0], tuple(members[gid]), info[gid][1], info[gid][2], info[gid][3])
        for gid in sorted(members)
    ]
    ctx.stats["groups"] = len(ctx.groups)
    n_nodes = sum(len(m) for m in members.values())
    log.info("coarsen: %d nodes -> %d decision groups", n_nodes, len(ctx.groups))
    return gm
