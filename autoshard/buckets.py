"""Which placement changes the lowering bundles with others into one collective
(``autoshard/compiler/lower_buckets.py``).

Pure predicates on placements, shared by the lowering (which bundles these moves) and the cost model (which
prices a bucketed all-reduce's latency once per bucket, not once per gradient):

- ``bucketable``: a gradient's Partial(sum) -> Replicate (other axes unchanged), flattened with others into DDP's
  all-reduce buckets;
- ``scatter_axes``: a gradient's Partial(sum) -> Shard(d), reduce-scattered in buckets with others (FSDP2's);
- ``gather_axes``: a parameter's Shard(d) -> Replicate, all-gathered with its layer's others (FSDP's);
- ``bucket_share``: the part of one bucket's latency a gradient riding it pays, as the solver prices it;
- ``bucket_starts``: where each bucket of a run of gradients begins (DDP's sizes: the first bucket small);
- ``gather_all`` / ``gather_together``: the bundled all-gather itself (traced by the lowering, run eagerly by
  ``runtime.param_state`` for ZeRO's masters after the step).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from autoshard import _torch_compat as tc
from autoshard.config import BUCKET_BYTES, FIRST_BUCKET_BYTES

__all__ = [
    "bucket_share",
    "bucket_starts",
    "bucketable",
    "gather_all",
    "gather_axes",
    "gather_together",
    "scatter_axes",
]


def bucketable(have: tuple, want: tuple) -> bool:
    """A move that only sums Partial(sum) into Replicate on some axes, every other axis unchanged and not Partial
    (a Shard there stays: each rank's local piece is flattened with other gradients' and reduced over the summed
    axes only; fsdp+tp's column-parallel bias, [P, S(0)] -> [R, S(0)])."""
    moves = False
    for h, w in zip(have, want):
        if h == w:
            if isinstance(h, Partial):
                return False
            continue
        if not (isinstance(h, Partial) and h.reduce_op == "sum" and isinstance(w, Replicate)):
            return False
        moves = True
    return moves


def gather_axes(
    have: tuple, want: tuple, shape: tuple[int, ...], mesh_shape: tuple[int, ...]
) -> tuple[int, ...] | None:
    """The mesh axes of a move that is only even all-gathers of one tensor dim (Shard(d) -> Replicate on each of
    them, the same d, every other axis unchanged and not splitting d: FSDP's [S(0)], on a 2-D mesh [S(0), S(0)] ->
    [R, R], or fsdp+tp's column-parallel [S(1), S(0)] -> [R, S(0)]); None for any other move."""
    axes = tuple(a for a, (h, w) in enumerate(zip(have, want)) if h != w)
    if not axes or any(not isinstance(have[a], Shard) or not isinstance(want[a], Replicate) for a in axes):
        return None
    dim = have[axes[0]].dim
    if any(have[a].dim != dim for a in axes):
        return None
    return axes if _dim_only_on(dim, axes, have, shape, mesh_shape) else None


def _dim_only_on(
    dim: int, axes: tuple[int, ...], placements: tuple, shape: tuple[int, ...], mesh_shape: tuple[int, ...]
) -> bool:
    """Whether tensor dim ``dim`` splits evenly over ``axes`` and no other axis of ``placements`` splits it."""
    if any(isinstance(p, Shard) and p.dim == dim for i, p in enumerate(placements) if i not in axes):
        return False
    parts = 1
    for a in axes:
        parts *= mesh_shape[a]
    return 0 <= dim < len(shape) and shape[dim] % parts == 0


def scatter_axes(
    have: tuple, want: tuple, shape: tuple[int, ...], mesh_shape: tuple[int, ...]
) -> tuple[int, ...] | None:
    """The mesh axes of a move that only reduce-scatters one tensor dim (Partial(sum) -> Shard(d) on each of them,
    the same d, evenly, every other axis unchanged and not splitting d: an FSDP gradient, [S(0)] or fsdp+tp's
    [S(1), S(0)]); None for any other move."""
    axes = tuple(a for a, (h, w) in enumerate(zip(have, want)) if h != w)
    if not axes or any(
        not (isinstance(have[a], Partial) and have[a].reduce_op == "sum") or not isinstance(want[a], Shard)
        for a in axes
    ):
        return None
    dim = want[axes[0]].dim
    if any(want[a].dim != dim for a in axes):
        return None
    return axes if _dim_only_on(dim, axes, want, shape, mesh_shape) else None


def bucket_share(have: tuple, want: tuple, shape: tuple[int, ...], mesh_shape: tuple[int, ...], nbytes: int) -> float:
    """The share of one bucket's latency a gradient's move pays when it rides a bucket (``bucketable`` or
    ``scatter_axes``): the part of a bucket its local ``nbytes`` fill, or a whole bucket when they fill more than
    half of one; 0 for any other move. Buckets are filled in order and closed when the next gradient does not fit
    (``bucket_starts``), so no two gradients of over half a bucket share one: GPT-2 1.5B's layer of gradients of
    20.5, 20.5, 15.4 and 5.1 MB makes three buckets and a share of a fourth (the bytes alone, 2.35 buckets)."""
    if not (bucketable(have, want) or scatter_axes(have, want, shape, mesh_shape) is not None):
        return 0.0
    return 1.0 if 2 * nbytes > BUCKET_BYTES else nbytes / BUCKET_BYTES


def bucket_starts(sizes: Sequence[int], first: int = FIRST_BUCKET_BYTES, limit: int = BUCKET_BYTES) -> list[int]:
    """The index of each bucket's first member, for members of ``sizes`` bytes in the order they are made:
    consecutive members fill a bucket up to ``first`` bytes (the first bucket) or ``limit`` (the others); a
    member larger than that is a bucket of its own."""
    starts: list[int] = []
    size = 0
    for i, nbytes in enumerate(sizes):
        if not starts or size + nbytes > (first if len(starts) == 1 else limit):
            starts.append(i)
            size = 0
        size += nbytes
    return starts


def gather_all(mesh: DeviceMesh, axes: tuple[int, ...], vals: list[DTensor]) -> list[DTensor]:
    """:func:`gather_together` over all of ``axes`` at once: one all-gather over the flattened axes (their ranks
    row-major, as a dim split on mesh axes 0 and 1 is split by axis 0 first, then each piece by axis 1)."""
    if len(axes) > 1 and not mesh.mesh_dim_names:  # no flattened mesh without names: one axis at a time,
        for a in sorted(axes, reverse=True):  # innermost first (axis 1's pieces are put back together first)
            vals = gather_all(mesh, (a,), vals)
        return vals
    wants = [tuple(Replicate() if i in axes else p for i, p in enumerate(v.placements)) for v in vals]
    return gather_together(mesh, tuple(sorted(axes)), vals, wants)


def gather_together(mesh: DeviceMesh, axes: tuple[int, ...], vals: list[DTensor], wants: list[tuple]) -> list[DTensor]:
    """All-gather several DTensors, each split along one dim by ``axes`` (and by no other axis), with ONE
    collective of their flattened local shards; each comes back with its ``wants`` placements (Replicate on
    ``axes``), its dim put back together from the ranks' shards in rank order.

    Each comes back contiguous, the layout the program was traced with (and its DTensor's strides say): a piece
    of the gathered buffer can be a strided view of it (one element or row per rank, e.g. a norm's weight of
    width 4 on 4 ranks), and some ATen kernels read a parameter as contiguous without checking
    (``native_group_norm`` on CPU reads its weight and bias that way, and gave wrong results)."""
    locals_ = [v.to_local() for v in vals]
    k = math.prod(mesh.size(a) for a in axes)
    flat = torch.cat([t.reshape(-1) for t in locals_]) if len(locals_) > 1 else locals_[0].reshape(-1)
    gathered = tc.all_gather_dim0(flat, mesh, axes).view(k, -1)
    out, offset = [], 0
    for v, t, want in zip(vals, locals_, wants):
        n, d = t.numel(), v.placements[axes[0]].dim
        piece = gathered[:, offset : offset + n].reshape(k, *t.shape)  # rank r's shard, r = 0..k-1
        piece = piece.movedim(0, d).reshape(*t.shape[:d], k * t.shape[d], *t.shape[d + 1 :]).contiguous()
        offset += n
        out.append(DTensor.from_local(piece, mesh, want, run_check=False, shape=v.shape, stride=v.stride()))
    return out
