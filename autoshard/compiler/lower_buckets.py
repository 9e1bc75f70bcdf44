"""Several tensors, one collective: the gradient buckets and parameter gather groups ``lower`` traces.

Not a pass of its own: helpers of ``autoshard/compiler/lower.py``'s ``PlanInterpreter`` (which calls them while
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

import math

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from autoshard import _torch_compat as tc
from autoshard.buckets import bucket_starts


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
    # the flat tensor has one dim: a Shard kept on another axis (a tp-sharded weight's gradient, reduced over dp)
    # is Shard(0) of it, a layout on that axis the reduction does not touch
    flat_have, flat_want = (tuple(Shard(0) if isinstance(p, Shard) else p for p in pl) for pl in (have, want))
    reduced = tc.redistribute(DTensor.from_local(flat, mesh, flat_have, run_check=False), mesh, flat_want).to_local()
    pieces = torch.split(reduced, [t.numel() for t in locals_])
    return [p.view(t.shape) for p, t in zip(pieces, locals_)]


def scatter_together(mesh: DeviceMesh, axes: tuple[int, ...], vals: list[DTensor], dim: int = 0) -> list[torch.Tensor]:
    """Reduce-scatter several gradients along ``dim`` with ONE collective over the flattened ``axes`` (FSDP2's
    gradient reduce-scatter): each local piece is cut along ``dim`` into ``prod(axes)`` chunks, chunk r of every
    gradient goes to flat rank r together (row-major over the axes: a dim split on mesh axes 0 and 1 is split by
    axis 0 first). Returns this rank's local shards."""
    locals_ = [v.to_local() for v in vals]
    groups = [tuple(sorted(axes))] if mesh.mesh_dim_names else [(a,) for a in sorted(axes)]  # outer axis first
    for group in groups:
        k = math.prod(mesh.size(a) for a in group)
        # chunk r of each gradient as row r: (k, rest), by moving the k chunks of ``dim`` in front
        flat = torch.cat(
            [t.unflatten(dim, (k, t.shape[dim] // k)).movedim(dim, 0).reshape(k, -1) for t in locals_], dim=1
        )
        mine = tc.reduce_scatter_dim0(flat, mesh, group).reshape(-1)
        pieces = torch.split(mine, [t.numel() // k for t in locals_])
        locals_ = [p.view(*t.shape[:dim], t.shape[dim] // k, *t.shape[dim + 1 :]) for p, t in zip(pieces, locals_)]
    return locals_
