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
from torch.distributed.tensor import DTensor, Replicate

from autoshard import _torch_compat as tc

from autoshard.buckets import bucket_starts, bucketable, gather_axes, scatter_axes  # noqa: F401 (lower's too)
from autoshard.config import BUCKET_BYTES, FIRST_BUCKET_BYTES  # noqa: F401 (lower's bucket sizes, DDP's)


def by_size(members: list[tuple[int, DTensor]], first: int, limit: int) -> list[list[tuple[int, DTensor]]]:
    """Consecutive members in buckets of at most ``first`` bytes (the first) and ``limit`` bytes (the others);
    a member larger than that is a bucket of its own (``autoshard.buckets.bucket_starts``)."""
    starts = bucket_starts([v.to_local().numel() * v.element_size() for _, v in members], first, limit)
    return [members[a:b] for a, b in zip(starts, [*starts[1:], len(members)])] or [[]]


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
