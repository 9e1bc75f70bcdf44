"""Several tensors, one collective: the gradient buckets and parameter gather groups ``lower`` traces.

Not a pass of its own: helpers of ``passes/lower.py``'s ``PlanInterpreter`` (which calls them while
``make_fx`` traces a rank's program, so the collectives they issue land in the lowered graph like any other).

- Gradient buckets (DDP's): gradients that only need Partial -> Replicate are flattened, concatenated and
  all-reduced together, in buckets of <= 1 MiB (the first) and <= 25 MiB (the others), in the order the backward
  makes them.
- Gather groups (FSDP's per-block all-gather): the parameters of one layer that a phase (forward or backward)
  gathers from Shard(0) on one mesh axis to Replicate are gathered by ONE all-gather at the first use of any
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

BUCKET_BYTES = 25 * 2**20  # per gradient bucket, DDP's default
FIRST_BUCKET_BYTES = 2**20  # the first bucket is small, as DDP's, so that its reduction starts early


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


def gather_axis(have: tuple, want: tuple, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> int | None:
    """The mesh axis of a move that is exactly one even all-gather along dim 0 (Shard(0) -> Replicate on that
    axis, every other axis unchanged and not splitting dim 0); None for any other move."""
    axes = [a for a, (h, w) in enumerate(zip(have, want)) if h != w]
    if len(axes) != 1:
        return None
    a = axes[0]
    if have[a] != Shard(0) or not isinstance(want[a], Replicate):
        return None
    if any(isinstance(p, Shard) and p.dim == 0 for i, p in enumerate(have) if i != a):
        return None
    if not shape or shape[0] % mesh_shape[a] != 0:
        return None
    return a


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
