"""overlap: order a rank's forward and backward graphs so that communication runs while it computes.

Needs: ``partition`` (``ctx.forward_graph`` and ``ctx.backward_graph``, from ``lower``'s graph:
``_c10d_functional`` collectives, each followed by its ``wait_tensor``, in the order the interpreter traced
them: a gradient bucket's reduction comes after the whole backward, its ``wait_tensor`` right after it).

Does, on one graph, keeping it a valid topological order:

- raises every collective, and the cheap data movement that only feeds collectives (a bucket's flattening
  ``view``/``cat``), to just after the last of its inputs is made: a gradient bucket starts reducing as soon as
  its last gradient exists, while the backward goes on with earlier layers (DDP's overlap);
- sinks every ``wait_tensor`` to just before the first op that uses its result.

Collectives keep their relative order (every rank runs the same graph, so they are issued in the same order on
every rank), and no op moves across the forward/backward boundary: the pass runs on each graph on its own.
Process groups run collectives on their own threads (gloo) or streams (NCCL), so the compute between issue
and wait overlaps them. Inductor keeps this order for its extern kernels (collectives and waits are not fused).
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from autoshard.passes.context import PassContext

log = logging.getLogger(__name__)

_aten = torch.ops.aten
# ops that only move or reshape data: cheap to run early, right after their inputs
_MOVES = {
    _aten.view.default, _aten._unsafe_view.default, _aten.reshape.default, _aten.cat.default,
    _aten.clone.default, _aten.t.default, _aten.permute.default, _aten.alias.default,
    _aten.expand.default, _aten.slice.Tensor, _aten.select.int, _aten.squeeze.dim, _aten.unsqueeze.default,
}


def _is_collective(n: fx.Node) -> bool:
    t = n.target
    return isinstance(t, torch._ops.OpOverload) and t.namespace == "_c10d_functional" and t._opname != "wait_tensor"


def _is_wait(n: fx.Node) -> bool:
    t = n.target
    return isinstance(t, torch._ops.OpOverload) and t.namespace == "_c10d_functional" and t._opname == "wait_tensor"


def _made_here(n: fx.Node, side: set[fx.Node]) -> bool:
    """Whether ``n`` (transitively through the communication side) reads a value this graph computes."""
    stack, seen = [n], set()
    while stack:
        m = stack.pop()
        for a in m.all_input_nodes:
            if a in seen:
                continue
            seen.add(a)
            if a.op == "call_function" and a not in side:
                return True
            if a in side:
                stack.append(a)
    return False


def _comm_side(graph: fx.Graph) -> set[fx.Node]:
    """Collectives on values the graph computes, and the data-movement ops all of whose users are such.

    A collective of a graph input (a parameter's all-gather) stays where it is: raised, every layer's weights
    would be gathered at the start of the graph (all of them in memory at once, which is what sharding them
    avoids, and as many collectives in flight)."""

    def closure(collectives: set[fx.Node]) -> set[fx.Node]:
        side = set(collectives)
        for n in reversed(graph.nodes):
            if n.op == "call_function" and n.target in _MOVES and n.users and all(u in side for u in n.users):
                side.add(n)
        return side

    every = closure({n for n in graph.nodes if n.op == "call_function" and _is_collective(n)})
    return closure({n for n in every if _is_collective(n) and _made_here(n, every)})


def schedule_overlap(gm: fx.GraphModule) -> dict[str, int]:
    """Reorder ``gm`` in place (see the module docstring); returns how many nodes were raised and sunk."""
    graph = gm.graph
    side = _comm_side(graph)
    raised = sunk = 0
    placed: set[fx.Node] = set()
    for n in [n for n in graph.nodes if n in side]:
        inputs = set(n.all_input_nodes)
        anchor = n.prev
        while anchor.op != "root" and anchor not in inputs:
            anchor = anchor.prev
        if anchor.op == "root":  # no inputs: nothing to raise it after
            placed.add(n)
            continue
        # behind the ops already raised to the same place, so that collectives keep their order
        while anchor.next is not n and anchor.next in placed:
            anchor = anchor.next
        if anchor.next is not n:
            anchor.append(n)
            raised += 1
        placed.add(n)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for w in [n for n in graph.nodes if _is_wait(n)]:
        if not w.users:
            continue
        first = min(w.users, key=order.__getitem__)
        if w.next is not first:
            first.prepend(w)
            sunk += 1
    graph.lint()
    gm.recompile()
    log.debug("overlap: raised %d collective-side ops, sank %d waits", raised, sunk)
    return {"raised": raised, "sunk": sunk}


def overlap(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """The overlap pass: ``schedule_overlap`` on the forward and on the backward graph (in place); the joint
    graph is returned unchanged. ``ctx.stats``: ``overlap_raised`` / ``overlap_sunk``."""
    for part in (ctx.forward_graph, ctx.backward_graph):
        if part is None:
            raise RuntimeError("overlap needs partition's forward and backward graphs")
        for k, v in schedule_overlap(part).items():
            ctx.stats[f"overlap_{k}"] = ctx.stats.get(f"overlap_{k}", 0) + v
    return gm
