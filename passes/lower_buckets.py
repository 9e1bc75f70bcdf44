"""Several tensors, one collective: the gradient buckets and parameter gather groups ``lower`` traces.

Not a pass of its own: helpers of ``passes/lower.py``'s ``PlanInterpreter`` (which calls them while
``make_fx`` traces a rank's program, so the collectives they issue land in the lowered graph like any other).

- Gradient buckets (DDP's): gradients that only need Partial -> Replicate are flattened, concatenated and
  all-reduced together, in buckets of <= 1 MiB (the first) and <= 25 MiB (the others), in the order the backward
  makes them.
- Gather groups (FSDP's per-block all-gather): the parameters of one layer that a phase (forward or backward)
  gathers from Shard(0) on some mesh axes to Replicate are gathered by ONE all-gather per axis at the first use of any
  of them: local shards flattened and concatenated, gathered, and each parameter cut back out (rank-major, as
  ``all_gather_into_tensor`` along dim 0 would have laid it out). The forward and the backward gather
  separately (nothing gathered is kept from one to the other: the memory the plan counted).

The values are the same, element by element, as one collective per tensor.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from autoshard import _torch_compat as tc

from autoshard.config import BUCKET_BYTES, FIRST_BUCKET_BYTES  # noqa: F401 (lower's bucket sizes, DDP's)


def bucketable(have: tuple, want: tuple) -> bool:
    """A move that only sums Partial(sum) into Replicate on some axes, with no Shard on either side (so the
    local pieces of several gradients can be flattened and reduced together)."""
    moves = False
    for h, w in zip(have, want):
        if isinstance(h, Shard) or isinstance(w, Shard):
            return False
        if h != w:
            if not (isinstance(h, Partial) and h.reduce_op == "sum" and isinstance(w, Replicate)):
                return False
            moves = True
    return moves


def by_size(members: list[tuple[int, DTensor]], first: int, limit: int) -> list[list[tuple[int, DTensor]]]:
    """Consecutive members in buckets of at most ``first`` bytes (the first) and ``limit`` bytes (the others);
    a member larger than that is a bucket of its own."""
    out: list[list[tuple[int, DTensor]]] = [[]]
    size = 0
    for slot, v in members:
        nbytes = v.to_local().numel() * v.element_size()
        if out[-1] and size + nbytes > (first if len(out) == 1 else limit):
            out.append([])
            size = 0
        out[-1].append((slot, v))
        size += nbytes
    return out


def reduce_together(mesh: DeviceMesh, vals: list[DTensor], have: tuple, want: tuple) -> list[torch.Tensor]:
    """Partial -> Replicate of several gradients as ONE collective: their local pieces flattened into one
    tensor, reduced, and cut back (local tensors, in ``vals``' order)."""
    locals_ = [v.to_local() for v in vals]
    if len(locals_) == 1:
        return [tc.redistribute(vals[0], mesh, want).to_local()]
    flat = torch.cat([t.reshape(-1) for t in locals_])
    reduced = tc.redistribute(DTensor.from_local(flat, mesh, have, run_check=False), mesh, want).to_local()
    pieces = torch.split(reduced, [t.numel() for t in locals_])
    return [p.view(t.shape) for p, t in zip(pieces, locals_)]


def gather_axes(have: tuple, want: tuple, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The mesh axes of a move that is only even all-gathers along dim 0 (Shard(0) -> Replicate on each of them,
    every other axis unchanged and not splitting dim 0: FSDP's [S(0)] or, on a 2-D mesh, [S(0), S(0)] -> [R, R]);
    None for any other move."""
    axes = tuple(a for a, (h, w) in enumerate(zip(have, want)) if h != w)
    if not axes or any(have[a] != Shard(0) or not isinstance(want[a], Replicate) for a in axes):
        return None
    return axes if _dim0_only_on(axes, have, shape, mesh_shape) else None


def _dim0_only_on(axes: tuple[int, ...], placements: tuple, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> bool:
    """Whether dim 0 splits evenly over ``axes`` and no other axis of ``placements`` splits it."""
    if any(isinstance(p, Shard) and p.dim == 0 for i, p in enumerate(placements) if i not in axes):
        return False
    parts = 1
    for a in axes:
        parts *= mesh_shape[a]
    return bool(shape) and shape[0] % parts == 0


def gather_all(mesh: DeviceMesh, axes: tuple[int, ...], vals: list[DTensor]) -> list[DTensor]:
    """:func:`gather_together` over several axes, innermost first (a dim split on mesh axes 0 and 1 is split by
    axis 0 first, then each piece by axis 1, so axis 1's pieces are put back together first)."""
    for a in sorted(axes, reverse=True):
        nxt = [tuple(Replicate() if i == a else p for i, p in enumerate(v.placements)) for v in vals]
        vals = gather_together(mesh, a, vals, nxt)
    return vals  # Replicate on every gathered axis, the rest unchanged: what the members want


def gather_together(mesh: DeviceMesh, axis: int, vals: list[DTensor], wants: list[tuple]) -> list[DTensor]:
    """All-gather several Shard(0)-on-``axis`` DTensors with ONE collective; each comes back with its ``wants``
    placements (Replicate on ``axis``)."""
    locals_ = [v.to_local() for v in vals]
    k = mesh.size(axis)
    flat = torch.cat([t.reshape(-1) for t in locals_]) if len(locals_) > 1 else locals_[0].reshape(-1)
    gathered = funcol.all_gather_tensor(flat, 0, (mesh, axis)).view(k, -1)
    out, offset = [], 0
    for v, t, want in zip(vals, locals_, wants):
        n = t.numel()
        piece = gathered[:, offset : offset + n].reshape(k * t.shape[0], *t.shape[1:])
        offset += n
        out.append(DTensor.from_local(piece, mesh, want, run_check=False, shape=v.shape, stride=v.stride()))
    return out


def scatter_axes(have: tuple, want: tuple, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The mesh axes of a move that only reduce-scatters along dim 0 (Partial(sum) -> Shard(0) on each of them,
    evenly, every other axis unchanged and not splitting dim 0: an FSDP gradient); None for any other move."""
    axes = tuple(a for a, (h, w) in enumerate(zip(have, want)) if h != w)
    if not axes or any(not (isinstance(have[a], Partial) and have[a].reduce_op == "sum") or want[a] != Shard(0)
                       for a in axes):
        return None
    return axes if _dim0_only_on(axes, want, shape, mesh_shape) else None


def scatter_together(mesh: DeviceMesh, axes: tuple[int, ...], vals: list[DTensor]) -> list[torch.Tensor]:
    """Reduce-scatter several gradients along dim 0 with ONE collective per axis (FSDP2's gradient reduce-scatter):
    each local piece is cut into the axis' chunks, chunk r of every gradient goes to rank r together. Outer axis
    first (a dim split on mesh axes 0 and 1 is split by axis 0 first). Returns this rank's local shards."""
    locals_ = [v.to_local() for v in vals]
    for a in sorted(axes):
        k = mesh.size(a)
        flat = torch.cat([t.reshape(k, -1) for t in locals_], dim=1)
        mine = funcol.reduce_scatter_tensor(flat, "sum", 0, (mesh, a)).reshape(-1)
        pieces = torch.split(mine, [t.numel() // k for t in locals_])
        locals_ = [p.view(t.shape[0] // k, *t.shape[1:]) for p, t in zip(pieces, locals_)]
    return locals_
