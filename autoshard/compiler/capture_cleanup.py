"""Clean-ups of the captured joint graph (part of ``capture``): what a stock model leaves in it that has no
placement to choose or that would make one tensor two decisions.

- metadata assertions go (nothing to place or run);
- constants the model made (``torch.tensor(...)``) get a ``meta["val"]`` and are copied with ``clone``;
- empty pieces of concatenations go (a lazily made KV cache starts as ``torch.tensor([])``);
- tied parameters (an LM head sharing the embedding's weight) become one placeholder with one gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch import nn

from autoshard import _torch_compat as tc


def drop_assertions(gm: fx.GraphModule) -> bool:
    """Remove metadata assertions (``_assert_tensor_metadata`` from an exported ``.to()``, as in the stage modules
    ``torch.distributed.pipelining`` cuts): checks of the traced program with no value to place or run."""
    aten = torch.ops.aten
    asserts = {aten._assert_tensor_metadata.default, aten._assert_scalar.default, aten._assert_async.msg}
    dropped = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in asserts and not n.users]
    for node in dropped:
        gm.graph.erase_node(node)
    return bool(dropped)


def constant_values(gm: fx.GraphModule, fake_mode: Any) -> bool:
    """Give constants the model made (``get_attr`` of a ``torch.tensor(...)``) a ``meta["val"]`` like every
    other node's, so that passes see their shape, and copy them with ``clone``."""
    for node in gm.graph.find_nodes(op="get_attr"):
        t = getattr(gm, node.target, None)
        if isinstance(t, torch.Tensor) and not isinstance(node.meta.get("val"), torch.Tensor):
            node.meta["val"] = fake_mode.from_tensor(t)
    changed = False
    # a one-element constant becomes the factory op that makes it: no real tensor inside the graph, which
    # the per-rank trace (make_fx under fake tensors) could not take
    for node in list(gm.graph.find_nodes(op="get_attr")):
        t = getattr(gm, node.target, None)
        if isinstance(t, torch.Tensor) and t.numel() == 1:
            with gm.graph.inserting_before(node):
                made = gm.graph.call_function(
                    torch.ops.aten.full.default, (list(t.shape), t.item()), {"dtype": t.dtype, "device": t.device}
                )
            made.meta.update(node.meta)
            node.replace_all_uses_with(made)
            gm.graph.erase_node(node)
            changed = True
    # the copy torch.tensor(...) makes of its constant is a clone, which has a sharding rule
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.lift_fresh_copy.default):
        node.target = torch.ops.aten.clone.default
        changed = True
    return changed


def drop_empty_concat_inputs(gm: fx.GraphModule) -> bool:
    """Remove empty pieces from concatenations (a lazily made cache starts as ``torch.tensor([])`` and is
    concatenated with the first keys and values): they add nothing, and a shape-(0,) tensor has no placement
    that fits the others. A concatenation left with one piece is that piece. Dead code goes after."""
    aten = torch.ops.aten
    changed = False
    for node in list(gm.graph.find_nodes(op="call_function", target=aten.cat.default)):
        pieces = node.args[0]
        kept = [p for p in pieces if not (isinstance(p, fx.Node) and _numel(p) == 0)]
        if len(kept) == len(pieces) or not kept:
            continue
        changed = True
        if len(kept) == 1 and tuple(kept[0].meta["val"].shape) == tuple(node.meta["val"].shape):
            node.replace_all_uses_with(kept[0])
            gm.graph.erase_node(node)
        else:
            node.args = (kept, *node.args[1:])
    for node in reversed(list(gm.graph.nodes)):
        if node.op in ("call_function", "get_attr") and not node.users and _pure(node):
            gm.graph.erase_node(node)
            changed = True
    return changed


def _numel(node: fx.Node) -> int | None:
    v = node.meta.get("val")
    return v.numel() if isinstance(v, torch.Tensor) else None


def _pure(node: fx.Node) -> bool:
    t = node.target
    if node.op == "get_attr":
        return True
    # (a random draw nothing reads still moves the generator, as one device's does: kept)
    return (
        isinstance(t, tc.OpOverload)
        and not t._schema.is_mutable
        and t.namespace != "_c10d_functional"
        and torch.Tag.nondeterministic_seeded not in t.tags
    )


def merge_tied_parameters(gm: fx.GraphModule, model: nn.Module) -> bool:
    """One placeholder per parameter tensor. The joint export gives every name of a tied parameter its own
    placeholder and its own share of the gradient; left so, the solver could place the two names differently
    while the runtime holds one tensor. The other names' uses read the first name's placeholder, and the
    first name's gradient becomes the sum of all the shares."""
    first: dict[int, str] = {}
    canon: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        canon[name] = first.setdefault(id(p), name)
    if all(a == b for a, b in canon.items()):
        return False
    holders = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        desc = node.meta.get("desc")
        if type(desc).__name__ == "ParamAOTInput":
            holders[_strip(desc.target)] = node
    out_node = gm.graph.find_nodes(op="output")[0]
    outs = list(out_node.args[0])
    descs = list(out_node.meta.get("desc") or [None] * len(outs))
    grad_at = {}
    for i, d in enumerate(descs):
        if type(d).__name__ == "GradAOTOutput" and type(d.grad_of).__name__ == "ParamAOTInput":
            grad_at[_strip(d.grad_of.target)] = i
    drop: set[int] = set()
    for alias, owner in canon.items():
        if alias == owner or alias not in holders or owner not in holders:
            continue
        holders[alias].replace_all_uses_with(holders[owner])
        gm.graph.erase_node(holders[alias])
        i, j = grad_at.get(owner), grad_at.get(alias)
        if j is None:
            continue
        drop.add(j)
        if i is None or outs[j] is None:
            continue
        if outs[i] is None:
            outs[i] = outs[j]
            continue
        with gm.graph.inserting_before(out_node):
            total = gm.graph.call_function(torch.ops.aten.add.Tensor, (outs[i], outs[j]))
        total.meta.update({k: v for k, v in outs[i].meta.items() if k not in ("val", "desc")})
        total.meta["val"] = outs[i].meta["val"] + outs[j].meta["val"]
        outs[i] = total
    keep = [k for k in range(len(outs)) if k not in drop]
    out_node.args = ([outs[k] for k in keep],)
    out_node.meta["desc"] = [descs[k] for k in keep]
    return True


def _strip(name: str) -> str:
    """A parameter's name in the model (capture's wrapper prefixes ``inner.``)."""
    return name[len("inner.") :] if name.startswith("inner.") else name
