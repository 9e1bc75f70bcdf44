"""overlap: order a rank's forward and backward graphs so that communication runs while it computes.

Needs: ``partition`` (``ctx.forward_graph`` and ``ctx.backward_graph``, from ``lower``'s graph:
``_c10d_functional`` collectives, each followed by its ``wait_tensor``, in the order the interpreter traced
them: a gradient bucket's reduction comes after the whole backward, its ``wait_tensor`` right after it).

Does, on one graph, keeping it a valid topological order:

- raises every collective, and the cheap data movement that only feeds collectives (a bucket's flattening
  ``view``/``cat``), to just after the last of its inputs is made: a gradient bucket starts reducing as soon as
  its last gradient exists, while the backward goes on with earlier layers (DDP's overlap);
- issues each parameter all-gather (a collective of graph inputs, which is not raised: see ``_comm_side``) right
  after the previous one, FSDP's one-layer prefetch;
- sinks every ``wait_tensor`` to just before the first op that uses its result, or, where that is later, to just
  before the collective issued ``IN_FLIGHT`` after its own (a bounded number in flight, each holding its buffers).

On gloo one collective is in flight at a time (``in_flight_for``): two concurrent gloo all-gathers corrupt the
heap (torch 2.13, CPU; measured with plain ``_c10d_functional`` ops, no autoshard code, 2 ranks x 2,000 iterations
of 11 all-gathers: "malloc(): unaligned tcache chunk detected" or SIGSEGV in 4 of 6 runs with two in flight, 0 of 8
with one in flight while the main thread computes, 0 of 8 waiting each at once). The compute between issue and
wait still overlaps it.

Collectives keep their relative order (every rank runs the same graph, so they are issued in the same order on
every rank), and no op moves across the forward/backward boundary: the pass runs on each graph on its own.
Process groups run collectives on their own threads (gloo) or streams (NCCL), so the compute between issue
and wait overlaps them. Inductor keeps this order for its extern kernels (collectives and waits are not fused).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh

from autoshard.compiler.context import PassContext
from autoshard.errors import InternalError

log = logging.getLogger(__name__)

_aten = torch.ops.aten
# ops that only move or reshape data: cheap to run early, right after their inputs
_MOVES = {
    _aten.view.default,
    _aten._unsafe_view.default,
    _aten.reshape.default,
    _aten.cat.default,
    _aten.clone.default,
    _aten.t.default,
    _aten.permute.default,
    _aten.alias.default,
    _aten.expand.default,
    _aten.slice.Tensor,
    _aten.select.int,
    _aten.squeeze.dim,
    _aten.unsqueeze.default,
}


# dtype casts of a parameter (mixed precision's compute copies) are graph-input values too
_CASTS = {_aten._to_copy.default, _aten.view.dtype}


def _is_collective(n: fx.Node) -> bool:
    t = n.target
    return isinstance(t, torch._ops.OpOverload) and t.namespace == "_c10d_functional" and t._opname != "wait_tensor"


def _is_wait(n: fx.Node) -> bool:
    t = n.target
    return isinstance(t, torch._ops.OpOverload) and t.namespace == "_c10d_functional" and t._opname == "wait_tensor"


def _moved_input(n: fx.Node, memo: dict[fx.Node, bool]) -> bool:
    """Whether ``n`` is a graph input, or only moves/reshapes/casts graph inputs (a parameter's flattened view
    that the layer's matmul also reads): no value this graph computes."""
    if n not in memo:
        if n.op in ("placeholder", "get_attr"):
            memo[n] = True
        else:
            memo[n] = (
                n.op == "call_function"
                and n.target in _MOVES | _CASTS
                and all(_moved_input(a, memo) for a in n.all_input_nodes)
            )
    return memo[n]


def _made_here(n: fx.Node, side: set[fx.Node], memo: dict[fx.Node, bool]) -> bool:
    """Whether ``n`` (transitively through the communication side) reads a value this graph computes."""
    stack, seen = [n], set()
    while stack:
        m = stack.pop()
        for a in m.all_input_nodes:
            if a in seen:
                continue
            seen.add(a)
            if a.op == "call_function" and a not in side and not _moved_input(a, memo):
                return True
            if a in side:
                stack.append(a)
    return False


def _comm_side(graph: fx.Graph) -> set[fx.Node]:
    """Collectives on values the graph computes, and the data-movement ops all of whose users are such.

    A collective of a graph input (a parameter's all-gather, also of a view or cast of parameters that other ops
    read too) stays where it is: raised, every layer's weights would be gathered at the start of the graph (all of
    them in memory at once, which is what sharding them avoids, and as many collectives in flight)."""

    def closure(collectives: set[fx.Node]) -> set[fx.Node]:
        side = set(collectives)
        for n in reversed(graph.nodes):
            if n.op == "call_function" and n.target in _MOVES and n.users and all(u in side for u in n.users):
                side.add(n)
        return side

    every = closure({n for n in graph.nodes if n.op == "call_function" and _is_collective(n)})
    memo: dict[fx.Node, bool] = {}
    return closure({n for n in every if _is_collective(n) and _made_here(n, every, memo)})


IN_FLIGHT = 2  # collectives issued and not yet waited on, at most: each holds its input's copy and its output


def schedule_overlap(gm: fx.GraphModule, in_flight: int = IN_FLIGHT) -> dict[str, int]:
    """Reorder ``gm`` in place (see the module docstring), with at most ``in_flight`` collectives issued and not
    waited on; returns how many nodes were raised and sunk."""
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
    raised += _prefetch_one_ahead(graph, side)
    sunk -= _bound_in_flight(graph, in_flight)
    graph.lint()
    gm.recompile()
    log.debug("overlap: raised %d collective-side ops, sank %d waits", raised, sunk)
    return {"raised": raised, "sunk": sunk}


def in_flight_for(mesh: DeviceMesh) -> int:
    """How many collectives may be in flight on ``mesh``'s process groups: one where any is gloo (see the module
    docstring), else ``IN_FLIGHT``."""
    if not dist.is_initialized():
        return IN_FLIGHT
    backends = {str(dist.get_backend(mesh.get_group(i))).lower() for i in range(mesh.ndim)}
    return 1 if "gloo" in backends else IN_FLIGHT


def _bound_in_flight(graph: fx.Graph, in_flight: int) -> int:
    """Move a collective's wait up to just before the collective issued ``in_flight`` later, where it was later:
    a wait sunk to its first use would otherwise keep every layer's gradient reduction (gloo copies each input)
    in flight until the end of the backward. One pass in graph order. Returns how many waits were moved."""
    outstanding: list[fx.Node] = []  # issued collectives whose wait has not been passed, oldest first
    waited: set[fx.Node] = set()
    moved = 0
    for n in list(graph.nodes):
        if n.op != "call_function":
            continue
        if _is_wait(n):
            waited.add(n)
            outstanding = [c for c in outstanding if n not in c.users]
        elif _is_collective(n):
            while len(outstanding) >= in_flight:
                w = next((u for u in outstanding.pop(0).users if _is_wait(u)), None)
                if w is not None and w not in waited:
                    n.prepend(w)
                    waited.add(w)
                    moved += 1
            outstanding.append(n)
    return moved


def _prefetch_one_ahead(graph: fx.Graph, side: set[fx.Node]) -> int:
    """FSDP's prefetch: each collective of graph inputs (a layer's parameter all-gather, which stays at its layer)
    is issued, with the views and casts that prepare it, just before the previous one is waited on (where the
    previous layer starts computing), so that it runs while that layer computes; at most two layers' gathered
    parameters are alive. Runs after the waits are sunk. Returns how many nodes were moved."""
    memo: dict[fx.Node, bool] = {}
    kept = [
        n
        for n in graph.nodes
        if n.op == "call_function"
        and _is_collective(n)
        and n not in side
        and all(_moved_input(a, memo) for a in n.all_input_nodes)
    ]
    moved = 0
    pos = {n: float(i) for i, n in enumerate(graph.nodes)}  # positions, kept up to date as nodes move
    for prev, nxt in zip(kept, kept[1:]):
        wait = next((u for u in prev.users if _is_wait(u)), None)
        if wait is None or pos[nxt] < pos[wait]:
            continue
        prep, stack = set(), [nxt]
        while stack:
            for a in stack.pop().all_input_nodes:
                if a.op == "call_function" and a not in prep and pos[a] > pos[wait]:
                    prep.add(a)
                    stack.append(a)
        group = sorted(prep, key=pos.__getitem__) + [nxt]
        low = pos[wait.prev] if wait.prev.op != "root" else pos[wait] - 1
        for j, n in enumerate(group):  # evenly between the wait and the node before it
            pos[n] = low + (pos[wait] - low) * (j + 1) / (len(group) + 1)
            wait.prepend(n)
            moved += 1
    return moved


def overlap(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """The overlap pass: ``schedule_overlap`` on the forward and on the backward graph (in place); the joint
    graph is returned unchanged. ``ctx.stats``: ``overlap_raised`` / ``overlap_sunk``."""
    in_flight = in_flight_for(ctx.mesh)
    for part in (ctx.forward_graph, ctx.backward_graph):
        if part is None:
            raise InternalError("overlap needs partition's forward and backward graphs")
        for k, v in schedule_overlap(part, in_flight).items():
            ctx.stats[f"overlap_{k}"] = ctx.stats.get(f"overlap_{k}", 0) + v
    return gm
