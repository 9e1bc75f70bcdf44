"""Collective costs on one mesh axis, and the cost of changing a tensor's placements (docs/design.md,
"Communication").

Ring model on a single link, over an axis of ``n`` devices joined by a link of latency ``alpha`` (s per step)
and bandwidth ``beta`` (bytes/s per direction per device), for a message whose FULL size along that axis is
``b`` bytes (:func:`collective_time`)::

    all_gather, reduce_scatter   alpha*(n-1) + b*(n-1)/n/beta     each device sends (n-1) chunks of b/n
    all_reduce                   reduce_scatter + all_gather
    all_to_all                   the backend's algorithm (:mod:`autoshard.cost.collectives`): ``pairwise``
                                 (NCCL, each device sends its b*(n-1)/n**2) by default, ``ring`` (gloo:
                                 gathered whole, n times an all-gather's bytes)

A mesh axis of a real cluster may span nodes, partly inside each (``m`` devices per node on ``k`` nodes,
:meth:`ClusterProfile.axis_layout`). :func:`axis_collective` prices it per algorithm (``ring``, ``tree``,
``hierarchical``, formulas in :mod:`autoshard.cost.collectives`) and, with ``algorithm="auto"``, picks the
cheapest, as NCCL's tuner does. On an axis inside one node ``ring`` equals :func:`collective_time` on the
intra-node link; on one with ``m == 1`` it equals :func:`collective_time` on the network link.

:func:`redistribute_steps` turns ``src -> dst`` placements into those collectives, one mesh axis at a time, the
way DTensor's ``redistribute`` does, with the byte size each step sees given the sharding of the other axes at
that moment, each step priced by :func:`axis_collective` (``auto``). The order of the steps (why it is the
cheapest per-axis order) is in its docstring.

Everything here is plain Python arithmetic behind an ``lru_cache``: the planner prices O(10^5) edges.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.tensor import Placement

from autoshard.cluster.profile import AxisLayout, ClusterProfile, Link
from autoshard.cost.collectives import (
    COLLECTIVES,
    algorithm_time,
    best_algorithm,
    ring_bandwidth,
    ring_pass,
)
from autoshard.errors import InputError
from autoshard.notation import mesh_str, placements_str

__all__ = [
    "CollectiveStep",
    "axis_collective",
    "axis_collective_time",
    "collective_time",
    "point_to_point_time",
    "redistribute_steps",
    "redistribute_time",
    "sync_time",
]


def collective_time(kind: str, nbytes: int, n: int, link: Link, all_to_all: str = "pairwise") -> float:
    """Seconds for one ring collective of ``kind`` over ``n`` devices on one link; ``nbytes`` is the full
    (gathered) size; an all_to_all runs ``all_to_all`` (``pairwise``, or ``ring``: gathered whole)."""
    if kind not in COLLECTIVES:
        raise InputError(f"unknown collective kind {kind!r}; known kinds: {', '.join(COLLECTIVES)}")
    if n < 1:
        raise InputError(f"{kind} over {n} devices: a mesh axis has at least 1 device")
    if kind == "all_to_all":
        return algorithm_time(kind, nbytes, AxisLayout(n, n, 1), link, link, all_to_all, all_to_all)
    one_pass = ring_pass(nbytes, n, link.latency, link.bandwidth)
    return 2.0 * one_pass if kind == "all_reduce" else one_pass


def axis_collective(
    kind: str,
    nbytes: int,
    mesh_shape: Sequence[int],
    axis: int,
    cluster: ClusterProfile,
    algorithm: str = "auto",
) -> tuple[str, float]:
    """``(algorithm, seconds)`` for collective ``kind`` of full size ``nbytes`` over mesh axis ``axis``, laid
    over ``cluster`` by :meth:`ClusterProfile.axis_layout`. ``algorithm`` is one of :data:`ALGORITHMS` or
    ``"auto"`` (the cheapest applicable one); an algorithm that does not apply raises ValueError."""
    layout, intra, inter = cluster.axis_layout(mesh_shape, axis), cluster.intra_node, cluster.inter_node
    if algorithm == "auto":
        return best_algorithm(kind, nbytes, layout, intra, inter, cluster.all_to_all)
    return algorithm, algorithm_time(kind, nbytes, layout, intra, inter, algorithm, cluster.all_to_all)


def point_to_point_time(nbytes: int, mesh_shape: Sequence[int], axis: int, cluster: ClusterProfile) -> float:
    """Seconds for each device of mesh axis ``axis`` to send ``nbytes`` to one peer of that axis (all at once,
    each its own peer): on the network when the axis spans nodes (the peer is then off-node but for a few)."""
    layout = cluster.axis_layout(mesh_shape, axis)
    link = cluster.inter_node if layout.nodes > 1 else cluster.intra_node
    return link.latency + nbytes / link.bandwidth


def axis_collective_time(
    kind: str,
    nbytes: int,
    mesh_shape: Sequence[int],
    axis: int,
    cluster: ClusterProfile,
    algorithm: str = "auto",
) -> float:
    """Seconds of :func:`axis_collective`."""
    return axis_collective(kind, nbytes, mesh_shape, axis, cluster, algorithm)[1]


@dataclass(frozen=True)
class CollectiveStep:
    """One collective on mesh axis ``axis``; ``nbytes`` is the size gathered over that axis (still sharded
    along the other axes at that moment), ``time`` its predicted seconds with ``algorithm`` (one of
    :data:`ALGORITHMS`, the cheapest for this axis and size)."""

    kind: str
    axis: int
    nbytes: int
    time: float
    algorithm: str = "ring"


def redistribute_steps(
    src: Sequence[Placement],
    dst: Sequence[Placement],
    global_shape: Sequence[int],
    itemsize: int,
    mesh_shape: Sequence[int],
    cluster: ClusterProfile,
) -> tuple[CollectiveStep, ...]:
    """The collectives that move a tensor of ``global_shape`` from placements ``src`` to ``dst``.

    Per mesh axis ``i`` (``p = src[i]``, ``q = dst[i]``):

    ========================  ===============================================
    P -> R                    all_reduce
    P -> S(d)                 reduce_scatter
    S(d) -> R                 all_gather
    S(d) -> S(e), d != e      all_to_all
    R -> S(d), R -> P, p == q free (take the local chunk / keep as is)
    S -> P, P(op) -> P(op2)   impossible: ValueError
    ========================  ===============================================

    Order (each phase shrinks or keeps the tensor for the phases after it)::

        1. free R -> S(d)      the tensor gets smaller at no cost, so every later step moves fewer bytes
        2. reduce_scatter      fastest link first (ties: innermost axis first): the big message rides the
                               fast link, the slow link sees it already divided (hierarchical reduce-scatter)
        3. all_to_all          changes no shard count, so its position among 2-5 only sets its own size
        4. all_reduce          before any all_gather, on the smallest tensor (it costs 2x a gather per byte)
        5. all_gather          slowest link first (ties: outermost axis first): the slow link moves the small
                               message, the fast link the grown one (hierarchical all-gather)

    With equal links the order inside phases 2 and 5 does not change the total (``b*(n_a*n_b-1)/(n_a*n_b)``
    either way); it matters across nodes, e.g. ``[S(0), S(1)] -> [R, R]`` on dp=4 (IB) x tp=8 (NVLink)
    gathers over IB at 1/8 size instead of over NVLink at 1/4 size, about 8x less time. An axis's link speed
    here is its flat-ring bandwidth (:func:`autoshard.cost.collectives.ring_bandwidth`); each step is then
    priced with the cheapest algorithm for its axis and size (:func:`axis_collective`, ``auto``).

    Sizes: the local size divides the global one by the mesh size of every axis that currently holds a
    ``Shard`` (two axes sharding the same tensor dim divide by both); ``Partial`` does not shrink it. This is a
    lower bound when two axes swap the nesting order of one tensor dim (e.g. ``[S(0), R] -> [R, S(0)]``):
    DTensor may gather to full size there, and the planner should not rely on such moves being cheap.
    """
    if len(mesh_shape) != len(src) or len(mesh_shape) != len(dst):
        raise InputError(
            f"placements {placements_str(src)} -> {placements_str(dst)} do not match mesh shape {tuple(mesh_shape)}: "
            f"need one placement per mesh axis"
        )
    mesh = tuple(int(s) for s in mesh_shape)
    return _plan(tuple(src), tuple(dst), tuple(int(s) for s in global_shape), int(itemsize), mesh, cluster)


def redistribute_time(
    src: Sequence[Placement],
    dst: Sequence[Placement],
    global_shape: Sequence[int],
    itemsize: int,
    mesh_shape: Sequence[int],
    cluster: ClusterProfile,
) -> float:
    """Seconds to move from ``src`` to ``dst`` placements: the sum of :func:`redistribute_steps`."""
    return sum(step.time for step in redistribute_steps(src, dst, global_shape, itemsize, mesh_shape, cluster))


def sync_time(steps: Sequence[CollectiveStep], mesh_shape: Sequence[int], cluster: ClusterProfile) -> float:
    """What a redistribution costs on top of its ``steps`` when compute waits on it (:attr:`Link.sync`): every
    collective pays its link's sync, the second of a move too (on another mesh axis it meets other ranks, which
    may be anywhere: with 4 ranks on 2 cores, 120 collectives a step cost about 2 ms each); 0 without steps."""
    return sum(cluster.axis_link(mesh_shape, st.axis).sync for st in steps)


# Phase numbers of the docstring's order; free moves are phase 1 (they only update the sharding state).
_FREE_SCATTER, _REDUCE_SCATTER, _ALL_TO_ALL, _ALL_REDUCE, _ALL_GATHER = 1, 2, 3, 4, 5
_KIND = {
    _REDUCE_SCATTER: "reduce_scatter",
    _ALL_TO_ALL: "all_to_all",
    _ALL_REDUCE: "all_reduce",
    _ALL_GATHER: "all_gather",
}


@functools.lru_cache(maxsize=1 << 16)
def _plan(
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    shape: tuple[int, ...],
    itemsize: int,
    mesh: tuple[int, ...],
    cluster: ClusterProfile,
) -> tuple[CollectiveStep, ...]:
    ndim = len(shape)
    phases: list[tuple[int, int]] = []  # (phase, axis)
    for axis, (p, q) in enumerate(zip(src, dst)):
        _check_shard_dim(p, ndim, src, dst, shape)
        _check_shard_dim(q, ndim, src, dst, shape)
        phase = _phase(p, q, ndim)
        if phase is None:
            raise InputError(
                f"cannot redistribute {placements_str(src)} -> {placements_str(dst)} on mesh {mesh_str(mesh, ())}: "
                f"mesh axis {axis} goes {placements_str((p,))[1:-1]} -> {placements_str((q,))[1:-1]}, which no "
                f"collective does (a Shard or Replicate value can become Partial only as R -> P; Partial can only be "
                f"reduced to R or S)"
            )
        if phase:
            phases.append((phase, axis))

    intra, inter = cluster.intra_node, cluster.inter_node
    layouts = [cluster.axis_layout(mesh, axis) for axis in range(len(mesh))]

    def order(item: tuple[int, int]) -> tuple[float, ...]:
        phase, axis = item
        bw = ring_bandwidth(layouts[axis], intra, inter)
        if phase == _REDUCE_SCATTER:
            return (phase, -bw, -axis)
        if phase == _ALL_GATHER:
            return (phase, bw, axis)
        return (phase, axis)

    sharded = [p.is_shard() for p in src]
    total = math.prod(shape) * itemsize
    axes = sorted(a for _, a in phases)
    if len(phases) > 1 and all(ph == _ALL_REDUCE for ph, _ in phases) and axes == list(range(axes[0], axes[-1] + 1)):
        # Partial -> Replicate on neighbouring axes: ONE all-reduce over them flattened (as the lowering runs it,
        # _torch_compat.redistribute), laid out like one axis of their product
        merged = (*mesh[: axes[0]], math.prod(mesh[a] for a in axes), *mesh[axes[-1] + 1 :])
        divisor = math.prod(mesh[a] for a, s in enumerate(sharded) if s)
        nbytes = -(-total // divisor)
        algorithm, seconds = best_algorithm("all_reduce", nbytes, cluster.axis_layout(merged, axes[0]), intra, inter)
        return (CollectiveStep("all_reduce", axes[0], nbytes, seconds, algorithm),)
    steps: list[CollectiveStep] = []
    for phase, axis in sorted(phases, key=order):
        if phase == _FREE_SCATTER:
            sharded[axis] = True
            continue
        divisor = 1
        for other, is_sharded in enumerate(sharded):
            if is_sharded and other != axis:
                divisor *= mesh[other]
        nbytes = -(-total // divisor)  # ceil: uneven shards are padded to the largest one
        kind = _KIND[phase]
        algorithm, seconds = best_algorithm(kind, nbytes, layouts[axis], intra, inter, cluster.all_to_all)
        steps.append(CollectiveStep(kind, axis, nbytes, seconds, algorithm))
        sharded[axis] = phase in (_REDUCE_SCATTER, _ALL_TO_ALL)
    return tuple(steps)


def _phase(p: Placement, q: Placement, ndim: int) -> int | None:
    """Phase of the move ``p -> q`` on one axis; 0 = nothing to do, None = impossible."""
    if p.is_shard() and q.is_shard():
        return 0 if p.dim % ndim == q.dim % ndim else _ALL_TO_ALL
    if p == q:
        return 0
    if p.is_replicate():
        if q.is_shard():
            return _FREE_SCATTER
        return 0 if q.is_partial() else None  # R -> P: keep the value on one rank, zeros elsewhere
    if p.is_partial():
        if q.is_replicate():
            return _ALL_REDUCE
        if q.is_shard():
            return _REDUCE_SCATTER
        return None  # P(sum) -> P(avg): different reductions
    if p.is_shard() and q.is_replicate():
        return _ALL_GATHER
    return None


def _check_shard_dim(
    p: Placement, ndim: int, src: tuple[Placement, ...], dst: tuple[Placement, ...], shape: tuple[int, ...]
) -> None:
    if p.is_shard() and not -ndim <= p.dim < ndim:
        raise InputError(
            f"cannot redistribute {placements_str(src)} -> {placements_str(dst)}: {placements_str((p,))[1:-1]} "
            f"names tensor dim {p.dim}, but the tensor has shape {list(shape)} ({ndim} dims)"
        )
