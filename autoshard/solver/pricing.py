"""What each choice of the intra-op integer program costs (``solver/intra_op.py`` builds the program and solves it).

Per canonical decision group and candidate (identical layers share one group, with a multiplicity; a captured layer
may stand for several uncaptured ones): its compute and the moves inside it (``GroupStrategy.compute_s + comm_s``),
and every edge that collapses onto it. Per edge between two groups: ``R[p][q]``, the move of a tensor from its
producer's layout ``p`` to the layout ``q`` its consumer wants (``cost.reshard.reshard_time``). Graph outputs are
edges too: the loss must end Replicate, every gradient in its parameter's gradient layout.

A move the lowering makes one collective with others (``autoshard/buckets.py``) pays its bytes at full bandwidth
and its share of that bundle's latency and sync: a gradient's bucketed all-reduce or reduce-scatter the part of one
bucket (``config.BUCKET_BYTES``) its bytes fill, a parameter's all-gather one in its layer's gather group for that
phase (``ir.gather_group_sizes``); ZeRO's masters after the step pay theirs in ``compiler/strategies.py``. The shares
of a bundle whose members are all chosen sum to the one latency the lowering pays
(``compiler/plan_collectives.py`` prices the plan so, and ``per_edge=True`` as here).

Memory per candidate: state (parameter + gradient + optimizer bytes) and saved activations; per gradient edge, the
bytes of a gradient made larger than its layout, which waits whole for its bucket's reduce-scatter (counted for at
most two layers, as the backward's peak holds two: ``cost/memory.py``).
"""

from __future__ import annotations

import math
import operator
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch.fx as fx
from torch.distributed.tensor import Replicate

from autoshard.buckets import bucket_share, gather_axes
from autoshard.cluster.profile import ClusterProfile
from autoshard.cost.memory import local_bytes
from autoshard.cost.reshard import reshard_time as redistribute_time
from autoshard.ir import (
    Edge,
    Group,
    GroupStrategy,
    Placements,
    gather_group,
    gather_group_sizes,
    is_parameter,
    is_state,
    tensor_args,
)

__all__ = ["GRAD_SINK_CREDIT", "Prices", "collect_edges", "price_choices"]

# The reduction that brings a gradient to its parameter's layout runs after the op that produced it, while
# the rest of the backward still computes (DDP's bucketed all-reduce, FSDP's reduce-scatter); an all-gather
# that feeds an op sits in front of it. We credit that fraction of a gradient reduction as hidden. Without
# it, equal-volume alternatives (all-reduce the weight gradient vs gather activations and gather the
# result) tie and the choice is arbitrary; with it, the plan reduces gradients as every practical recipe does.
GRAD_SINK_CREDIT = 0.3


@dataclass(frozen=True)
class Prices:
    """Every term of the program over the canonical groups ``canon_ids``: per group and candidate the seconds
    ``unary`` and the bytes ``mem``; per edge ``(src group, dst group, src layout of each src candidate, dst layout
    of each dst candidate, R)`` in ``pair_costs``; the waiting gradients' bytes per edge (``pair_waits``, None for an
    edge that is no gradient's) and per candidate of a group that delivers its own (``unary_waits``)."""

    canon_ids: list[int]
    unary: dict[int, list[float]]
    mem: dict[int, list[float]]
    pair_costs: list[tuple[int, int, list[int], list[int], list[list[float]]]]
    pair_waits: list[list[list[float]] | None]
    unary_waits: dict[int, list[float]]


def collect_edges(gm: fx.GraphModule, groups: Sequence[Group], output_roles: Sequence) -> tuple[list[Edge], list]:
    """Data edges between groups (and within one), plus output sinks (loss, gradients)."""
    pos = {}
    for g in groups:
        for i, name in enumerate(g.members):
            pos[name] = (g.id, i)
    edges: list[Edge] = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        gid, m = pos[node.name]
        follow = node.meta.get("autoshard_follow", -1)
        for k, src in enumerate(tensor_args(node)):
            sg, _ = pos[src.name]
            if sg == gid and k == follow:
                continue  # the followed input: costed inside the group
            edges.append(Edge(sg, src.name, gid, m, k))
    out = gm.graph.find_nodes(op="output")[0]
    params = {n.meta["autoshard_role"].name: n for n in gm.graph.find_nodes(op="placeholder")}
    sinks = []
    for src, role in zip(out.args[0], output_roles):
        if not isinstance(src, fx.Node):
            continue
        if role.kind in ("loss", "output", "buffer"):  # replicated, as the runtime holds buffers
            sinks.append((src.name, None))
        elif role.kind in ("grad", "input_grad"):
            sinks.append((src.name, params[role.name].name))
    return edges, sinks


def price_choices(
    gm: fx.GraphModule,
    groups: Sequence[Group],
    strategies: dict[int, list[GroupStrategy]],
    canon: dict[int, int],
    output_roles: Sequence,
    mesh_shape: tuple[int, ...],
    cluster: ClusterProfile,
    weights: dict[int, float] | None = None,
    grad_itemsize: int | None = None,
) -> Prices:
    """Every term of the program (see the module docstring); ``weights``: how many layers a group stands for."""
    nodes = {n.name: n for n in gm.graph.nodes}
    pos = {name: (g.id, i) for g in groups for i, name in enumerate(g.members)}
    weight = {g.id: (weights or {}).get(g.id, 1.0) for g in groups}
    mult: dict[int, float] = defaultdict(float)
    for g in groups:
        mult[canon[g.id]] += weight[g.id]
    canon_ids = [g.id for g in groups if canon[g.id] == g.id]
    unary: dict[int, list[float]] = {c: [mult[c] * (s.compute_s + s.comm_s) for s in strategies[c]] for c in canon_ids}
    edges, sinks = collect_edges(gm, groups, output_roles)
    rep = tuple(Replicate() for _ in mesh_shape)

    group_size = gather_group_sizes(gm)  # the lowering's gather groups: parameters per (phase, layer)
    from_param = {n.name for n in gm.graph.nodes if is_parameter(n)}

    info: dict[str, tuple[tuple[int, ...], int, bool]] = {}
    layouts: dict[Placements, int] = {}  # each distinct layout numbered once: hashing placements is slow
    memo: dict[tuple, float] = {}
    tables: dict[tuple, list[list[float]]] = {}

    def lid(a: Placements) -> int:
        return layouts.setdefault(a, len(layouts))

    def rcost(
        node_name: str,
        a: Placements,
        b: Placements,
        ia: int,
        ib: int,
        itemsize: int | None = None,
        sink: bool = False,
        members: int = 0,
    ) -> float:
        """A move's seconds. A move the lowering bundles with others into one collective (``autoshard/buckets.py``)
        pays its bytes at full bandwidth and its share of the bundle's latency and sync
        (``cost.reshard.reshard_time``): a gradient's all-reduce or reduce-scatter to its layout (``sink``) the
        part of one bucket its bytes fill (``buckets.bucket_share``), a parameter's all-gather with its layer's
        ``members`` parameters one in ``members``. ``ia``, ``ib``: the layouts' numbers (``lid``)."""
        if ia == ib:
            return 0.0
        if node_name not in info:
            v = nodes[node_name].meta["val"]
            info[node_name] = (tuple(v.shape), v.element_size(), is_state(nodes[node_name]))
        shape, elsize, state = info[node_name]
        size = min(elsize, itemsize or elsize)
        key = (shape, size, state, ia, ib, sink, members)
        if key not in memo:
            if sink:
                share = bucket_share(a, b, shape, mesh_shape, local_bytes(math.prod(shape) * size, a, mesh_shape))
            else:
                share = 1.0 / members if members and gather_axes(a, b, shape, mesh_shape) is not None else 0.0
            # compute waits on a move that rides no bundle (Link.sync), unless it is a gradient's reduction
            memo[key] = redistribute_time(a, b, shape, size, mesh_shape, cluster, waits=not sink, bundle_share=share)
        return memo[key]

    # Edges of identical layers connect the same variables: key them by the canonical group's member (same
    # shape) so they merge into one edge with a multiplicity instead of one set of edge variables per layer.
    by_id = {g.id: g for g in groups}

    def canon_node(gid: int, member: int) -> str:
        return by_id[canon[gid]].members[member]

    pair_edges: dict[tuple, float] = defaultdict(float)
    for e in edges:
        src_member = pos[e.src_node][1]
        key = (
            canon[e.src_group],
            src_member,
            canon_node(e.src_group, src_member),
            canon[e.dst_group],
            ("in", e.dst_member, e.dst_arg),
        )
        pair_edges[key] += weight[e.dst_group]
    for src_name, param in sinks:
        sg, sm = pos[src_name]
        if param is None:
            pair_edges[(canon[sg], sm, canon_node(sg, sm), None, ("rep",))] += weight[sg]
        else:
            pg = pos[param][0]
            pair_edges[(canon[sg], sm, canon_node(sg, sm), canon[pg], ("param",))] += weight[sg]

    pair_costs: list[tuple[int, int, list[int], list[int], list[list[float]]]] = []
    # the step's gradients made larger than their layout wait whole for their bucket's reduce-scatter (FSDP's,
    # ZeRO-2's): two layers' worth at the backward's peak (``cost/memory.py``), so a gradient edge standing for
    # several layers counts at most twice. Per pair of ``pair_costs`` (None: a pair that is no gradient), and
    # per candidate for a gradient delivered inside its own group; in the memory row, not in ``memory``.
    pair_waits: list[list[list[float]] | None] = []
    unary_waits: dict[int, list[float]] = {c: [0.0] * len(strategies[c]) for c in canon_ids}

    def waits(grad: str, P: Sequence[Placements], Q: Sequence[Placements], times: float) -> list[list[float]]:
        val = nodes[grad].meta["val"]
        made = [local_bytes(val.numel() * val.element_size(), p, mesh_shape) for p in P]
        kept = [local_bytes(val.numel() * val.element_size(), q, mesh_shape) for q in Q]
        return [[times * a if a > b else 0.0 for b in kept] for a in made]

    for (cu, sm, src_name, cv, dst), m in pair_edges.items():
        su = strategies[cu]
        src_layouts = [s.outputs[sm][0] for s in su]
        if cv is None:  # loss sink
            for i, a in enumerate(src_layouts):
                unary[cu][i] += m * rcost(src_name, a, rep, lid(a), lid(rep))
            continue
        sv = strategies[cv]
        if dst[0] == "param":  # the gradient is delivered in its parameter's gradient layout
            dst_layouts = [s.outputs[0][0] if s.grad_placements is None else s.grad_placements for s in sv]
        else:
            dst_layouts = [s.inputs[dst[1]][dst[2]] for s in sv]
        sink = dst[0] == "param"
        members = 0
        if not sink and src_name in from_param:  # a parameter's gather joins its consumer's layer's group
            members = gather_group(nodes[by_id[cv].members[dst[1]]], group_size)
        if cu == cv:
            for i in range(len(su)):
                a, b = src_layouts[i], dst_layouts[i]
                unary[cu][i] += m * rcost(src_name, a, b, lid(a), lid(b), sink=sink, members=members)
                if sink:
                    unary_waits[cu][i] += waits(src_name, [a], [b], min(m, 2.0))[0][0]
            continue
        P = list(dict.fromkeys(src_layouts))  # distinct layouts in candidate order
        Q = list(dict.fromkeys(dst_layouts))
        w = m * (1.0 - GRAD_SINK_CREDIT) if dst[0] == "param" else m
        # gradients reduced in grad_itemsize (mixed precision's reduce_dtype), the rest in their own dtype
        size = grad_itemsize if dst[0] == "param" else None
        ip, iq = tuple(lid(p) for p in P), tuple(lid(q) for q in Q)  # (numbered once: hashing placements is slow)
        if src_name not in info:
            v = nodes[src_name].meta["val"]
            info[src_name] = (tuple(v.shape), v.element_size(), is_state(nodes[src_name]))
        block = (info[src_name], ip, iq, size, sink, members)  # edges alike (experts, layers): one price table
        if block not in tables:
            tables[block] = [
                [rcost(src_name, p, q, a, b, size, sink, members) for q, b in zip(Q, iq)] for p, a in zip(P, ip)
            ]
        R = [[w * r for r in row] for row in tables[block]]
        if all(r == 0 for row in R for r in row):
            continue
        p_at, q_at = {a: k for k, a in enumerate(P)}, {b: k for k, b in enumerate(Q)}
        pair_costs.append((cu, cv, [p_at[a] for a in src_layouts], [q_at[b] for b in dst_layouts], R))
        pair_waits.append(waits(src_name, P, Q, min(m, 2.0)) if sink else None)
    mem = {c: [mult[c] * (s.state_bytes + s.activation_bytes) for s in strategies[c]] for c in canon_ids}
    return Prices(canon_ids, unary, mem, pair_costs, pair_waits, unary_waits)
