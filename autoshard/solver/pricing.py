"""What each choice of the intra-op integer program costs (``solver/intra_op.py`` builds and solves the program).

Terms, in seconds per step, each with its multiplicity (identical layers share one decision group, and a
captured layer may stand for several uncaptured ones):

- **per candidate** (``unary``): a group's compute and the moves inside it (``GroupStrategy.compute_s + comm_s``,
  a ZeRO-1/2 master's gather after the optimizer step included), plus every edge that collapses onto one side;
- **per edge** (``pairs``): ``R[p][q]``, the move of a tensor from its producer's layout ``p`` to the layout ``q``
  its consumer wants (``cost.reshard.reshard_time``). Graph outputs are edges too: the loss must end Replicate,
  and every gradient must end in its parameter's gradient layout (an all-reduce for a replicated parameter, a
  reduce-scatter for a sharded one);
- **per bundle** (``bundle_s``): a collective the lowering issues once for several moves
  (``autoshard/buckets.py``). Its members pay their bytes at full bandwidth (``ClusterProfile.bundled``); the
  bundle's latency and sync (``cost.comm.bundle_latency``) are paid once if any member is chosen. A candidate or
  an edge term lists the bundles it joins, and the program gives each bundle a boolean that any chosen member
  forces on (a fixed charge).

The bundles are the lowering's (``compiler/plan_collectives.py`` prices the same ones from a solved graph):

- a gradient summed into Replicate (DDP's buckets) or reduce-scattered into a shard (FSDP2's): one bundle per
  move and dtype. Buckets hold ``config.BUCKET_BYTES`` each, so a member also pays its bytes' share of one
  bucket's latency, at most one whole (a gradient larger than a bucket is a bucket of its own); the bundle's
  fixed charge is the first bucket;
- a parameter (or a view of one) all-gathered from an even shard to Replicate (FSDP's): gathered with the rest
  of its layer, one bundle per (phase, layer, axes, dtype), paid once for every layer it stands for;
- a ZeRO-1/2 master gathered back to its compute layout after the optimizer step: all together, one bundle per
  (axes, dtype).

The reduction that brings a gradient to its parameter's layout runs after the op that produced it, while the
rest of the backward still computes (DDP's bucketed all-reduce, FSDP's reduce-scatter); an all-gather that feeds
an op sits in front of it. ``GRAD_SINK_CREDIT`` of a gradient's reduction (and of its buckets) is credited as
hidden. Without it, equal-volume alternatives (all-reduce the weight gradient vs gather activations and gather
the result) tie and the choice is arbitrary; with it, the plan reduces gradients as every practical recipe does.
"""

from __future__ import annotations

import math
import operator
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch.fx as fx
from torch.distributed.tensor import Replicate

from autoshard.buckets import bucketable, gather_axes, scatter_axes
from autoshard.cluster.profile import ClusterProfile
from autoshard.config import BUCKET_BYTES
from autoshard.cost.comm import bundle_latency
from autoshard.cost.reshard import reshard_time
from autoshard.ir import Edge, Group, GroupStrategy, Placements, is_state, layer_key, tensor_args, view_root
from autoshard.notation import local_shape

__all__ = ["GRAD_SINK_CREDIT", "Pair", "Prices", "bucket_move", "collect_edges", "parameter_gather", "price_choices",
           "state_gather"]

GRAD_SINK_CREDIT = 0.3


class Pair(NamedTuple):
    """An edge between two canonical groups: candidate i of ``src`` has layout ``src_layout[i]``, candidate j of
    ``dst`` wants ``dst_layout[j]``; ``R[p][q]`` seconds (multiplicity in), ``B[p][q]`` the bundles joined."""

    src: int
    dst: int
    src_layout: list[int]
    dst_layout: list[int]
    R: list[list[float]]
    B: list[list[tuple[int, ...]]]


@dataclass(frozen=True)
class Prices:
    """Every term of the objective: per canonical group and candidate ``unary`` seconds and the bundles
    ``unary_bundles`` it joins, the edges ``pairs``, and each bundle's fixed charge ``bundle_s``."""

    unary: dict[int, list[float]]
    unary_bundles: dict[int, list[tuple[int, ...]]]
    pairs: list[Pair]
    bundle_s: list[float]


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


def bucket_move(a: tuple, b: tuple, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> bool:
    """A gradient's move to its parameter's layout that rides a bucket: summed into Replicate or reduce-scattered."""
    return bucketable(a, b) or scatter_axes(a, b, shape, mesh_shape) is not None


def parameter_gather(src: fx.Node, a: tuple, b: tuple, mesh_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The mesh axes of a move of ``src`` that joins its layer's gather group: ``src`` is a parameter or a view of
    one, and the move only all-gathers one evenly split dim (``buckets.gather_axes``); None otherwise."""
    root = view_root(src)
    if root.op != "placeholder" or getattr(root.meta.get("autoshard_role"), "kind", None) != "parameter":
        return None
    return gather_axes(a, b, tuple(src.meta["val"].shape), mesh_shape)


def state_gather(s: GroupStrategy, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The mesh axes of the gather that brings candidate ``s``'s stepped master (ZeRO-1/2, offload) back to its
    compute layout after the optimizer step, when it joins the others' (``buckets.gather_axes``); else None."""
    state = s.state_placements
    if state is None or tuple(state) == tuple(s.outputs[0][0]):
        return None
    return gather_axes(tuple(state), tuple(s.outputs[0][0]), shape, mesh_shape)


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
    """Every term of the program over canonical groups ``{canon[g] for g}`` (see the module docstring)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    pos = {name: (g.id, i) for g in groups for i, name in enumerate(g.members)}
    weight = {g.id: (weights or {}).get(g.id, 1.0) for g in groups}
    mult: dict[int, float] = defaultdict(float)
    for g in groups:
        mult[canon[g.id]] += weight[g.id]
    canon_ids = [g.id for g in groups if canon[g.id] == g.id]
    unary = {c: [mult[c] * (s.compute_s + s.comm_s) for s in strategies[c]] for c in canon_ids}
    unary_bundles: dict[int, list[tuple[int, ...]]] = {c: [()] * len(strategies[c]) for c in canon_ids}
    rep = tuple(Replicate() for _ in mesh_shape)
    lean = cluster.bundled()
    bundle_ids: dict[tuple, int] = {}
    bundle_s: list[float] = []

    def bundle(key: tuple, seconds: float) -> int:
        """The id of bundle ``key`` (its fixed charge ``seconds``: the largest any member asks)."""
        if key not in bundle_ids:
            bundle_ids[key] = len(bundle_s)
            bundle_s.append(seconds)
        k = bundle_ids[key]
        bundle_s[k] = max(bundle_s[k], seconds)
        return k

    layouts: dict[Placements, int] = {}  # each distinct layout numbered once: hashing placements is slow
    info: dict[str, tuple[tuple[int, ...], int, bool]] = {}
    memo: dict[tuple, tuple[float, str, float]] = {}

    def move(node_name: str, a: Placements, b: Placements, itemsize: int | None = None, sink: bool = False
             ) -> tuple[float, str, float]:
        """A move's seconds for one member, the kind of bundle it joins ("bucket", "gather" or "") and that
        bundle's fixed charge. A move that waits (Link.sync) is one compute cannot start without, unless it is a
        gradient's reduction or a parameter's gather that the lowering does ahead with its layer's."""
        ia, ib = layouts.setdefault(a, len(layouts)), layouts.setdefault(b, len(layouts))
        if ia == ib:
            return 0.0, "", 0.0
        if node_name not in info:
            v = nodes[node_name].meta["val"]
            info[node_name] = (tuple(v.shape), v.element_size(), is_state(nodes[node_name]))
        shape, elsize, state = info[node_name]
        size = min(elsize, itemsize or elsize)
        gathered = not sink and state and parameter_gather(nodes[node_name], a, b, mesh_shape) is not None
        key = (shape, size, ia, ib, sink, gathered, state)
        if key not in memo:
            if sink and bucket_move(a, b, shape, mesh_shape):
                fixed = bundle_latency(a, b, mesh_shape, cluster)
                share = min(1.0, math.prod(local_shape(shape, a, mesh_shape)) * size / BUCKET_BYTES)
                memo[key] = (reshard_time(a, b, shape, size, mesh_shape, lean) + fixed * share, "bucket", fixed)
            elif gathered:
                fixed = bundle_latency(a, b, mesh_shape, cluster)
                memo[key] = (reshard_time(a, b, shape, size, mesh_shape, lean), "gather", fixed)
            else:
                waits = not sink and (not state or gather_axes(a, b, shape, mesh_shape) is None)
                memo[key] = (reshard_time(a, b, shape, size, mesh_shape, cluster, waits=waits), "", 0.0)
        return memo[key]

    def joined(kind: str, fixed: float, node_name: str, a: Placements, b: Placements, consumer: str, m: float,
               itemsize: int | None) -> tuple[int, ...]:
        if not kind:
            return ()
        if kind == "bucket":
            size = min(info[node_name][1], itemsize or info[node_name][1])
            return (bundle(("bucket", a, b, size), fixed * (1.0 - GRAD_SINK_CREDIT)),)
        cons = nodes[consumer]
        layer = layer_key(cons.meta.get("autoshard_module", "")) or ("", -1)
        axes = gather_axes(a, b, info[node_name][0], mesh_shape)
        dtype = view_root(nodes[node_name]).meta["val"].dtype
        return (bundle(("gather", cons.meta.get("autoshard_phase", "forward"), layer, axes, dtype), fixed * m),)

    # ZeRO-1/2 masters gathered back after the step: the strategy priced the member's bytes (strategies.py)
    by_id = {g.id: g for g in groups}
    for c in canon_ids:
        if by_id[c].kind != "parameter":
            continue
        val = nodes[by_id[c].anchor].meta["val"]
        for i, s in enumerate(strategies[c]):
            axes = state_gather(s, tuple(val.shape), mesh_shape)
            if axes is not None:
                fixed = bundle_latency(s.state_placements, s.outputs[0][0], mesh_shape, cluster)
                unary_bundles[c][i] = (bundle(("gather", "optimizer", axes, val.dtype), fixed),)

    # Edges of identical layers connect the same variables: key them by the canonical group's member (same
    # shape) so they merge into one edge with a multiplicity instead of one set of edge variables per layer.
    def canon_node(gid: int, member: int) -> str:
        return by_id[canon[gid]].members[member]

    edges, sinks = collect_edges(gm, groups, output_roles)
    pair_edges: dict[tuple, float] = defaultdict(float)
    for e in edges:
        src_member = pos[e.src_node][1]
        key = (canon[e.src_group], src_member, canon_node(e.src_group, src_member), canon[e.dst_group],
               ("in", e.dst_member, e.dst_arg))
        pair_edges[key] += weight[e.dst_group]
    for src_name, param in sinks:
        sg, sm = pos[src_name]
        if param is None:
            pair_edges[(canon[sg], sm, canon_node(sg, sm), None, ("rep",))] += weight[sg]
        else:
            pg = pos[param][0]
            pair_edges[(canon[sg], sm, canon_node(sg, sm), canon[pg], ("param",))] += weight[sg]

    pairs: list[Pair] = []
    for (cu, sm, src_name, cv, dst), m in pair_edges.items():
        su = strategies[cu]
        src_layouts = [s.outputs[sm][0] for s in su]
        if cv is None:  # loss sink
            for i, a in enumerate(src_layouts):
                unary[cu][i] += m * move(src_name, a, rep)[0]
            continue
        sv = strategies[cv]
        sink = dst[0] == "param"
        if sink:  # the gradient is delivered in its parameter's gradient layout
            dst_layouts = [s.outputs[0][0] if s.grad_placements is None else s.grad_placements for s in sv]
            consumer = ""
        else:
            dst_layouts = [s.inputs[dst[1]][dst[2]] for s in sv]
            consumer = by_id[cv].members[dst[1]]
        w = m * (1.0 - GRAD_SINK_CREDIT) if sink else m
        # gradients reduced in grad_itemsize (mixed precision's reduce_dtype), the rest in their own dtype
        size = grad_itemsize if sink else None

        def term(a: Placements, b: Placements) -> tuple[float, tuple[int, ...]]:
            seconds, kind, fixed = move(src_name, a, b, size, sink)
            return w * seconds, joined(kind, fixed, src_name, a, b, consumer, m, size)

        if cu == cv:
            for i in range(len(su)):
                seconds, bundles = term(src_layouts[i], dst_layouts[i])
                unary[cu][i] += seconds
                unary_bundles[cu][i] += bundles
            continue
        P = list(dict.fromkeys(src_layouts))  # distinct layouts in candidate order
        Q = list(dict.fromkeys(dst_layouts))
        terms = [[term(p, q) for q in Q] for p in P]
        R = [[t[0] for t in row] for row in terms]
        if all(r == 0 for row in R for r in row):
            continue
        p_at, q_at = {a: k for k, a in enumerate(P)}, {b: k for k, b in enumerate(Q)}
        pairs.append(Pair(cu, cv, [p_at[a] for a in src_layouts], [q_at[b] for b in dst_layouts], R,
                          [[t[1] for t in row] for row in terms]))
    return Prices(unary, unary_bundles, pairs, bundle_s)
