"""Functional collectives as autoshard issues them: one collective over several mesh axes (a flattened mesh),
the ``*_single`` names where torch has them (``*_tensor`` on torch 2.11), and waiting on an eager result."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh


def flat_mesh(mesh: DeviceMesh, axes: Sequence[int]) -> DeviceMesh:
    """The 1-D mesh of ``mesh``'s ``axes`` flattened (made once per root mesh and kept by it). Made outside any
    tracing mode: inside ``make_fx``'s fake tracing the mesh's own index tensors would be fake or recorded."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    names = tuple(mesh.mesh_dim_names[a] for a in axes)
    with unset_fake_temporarily(), disable_proxy_modes_tracing():
        return mesh[names]._flatten()


def _group(mesh: DeviceMesh, axes: Sequence[int]) -> Any:
    """What a functional collective takes for ``mesh``'s ``axes``: ``(mesh, axis)`` for one axis, the flattened
    1-D mesh for several (rank order row-major over them: a dim split on axes 0 and 1 is split by axis 0 first)."""
    return (mesh, axes[0]) if len(axes) == 1 else flat_mesh(mesh, axes)


def all_gather_dim0(t: torch.Tensor, mesh: DeviceMesh, axes: Sequence[int], dim: int = 0) -> torch.Tensor:
    """Functional all-gather of ``t`` along ``dim`` over ``mesh``'s ``axes`` as ONE collective (traceable;
    ``all_gather_single`` where torch has it, the older ``all_gather_tensor`` on torch 2.11)."""
    import torch.distributed._functional_collectives as funcol

    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    return gather(t, dim, _group(mesh, tuple(axes)))


def reduce_scatter_dim0(t: torch.Tensor, mesh: DeviceMesh, axes: Sequence[int]) -> torch.Tensor:
    """Functional sum-reduce-scatter of ``t`` along dim 0 over ``mesh``'s ``axes`` as ONE collective
    (``reduce_scatter_single`` where torch has it, ``reduce_scatter_tensor`` on torch 2.11)."""
    import torch.distributed._functional_collectives as funcol

    scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
    return scatter(t, "sum", 0, _group(mesh, tuple(axes)))


def all_reduce_on(t: torch.Tensor, op: str, mesh: DeviceMesh, axis: int) -> torch.Tensor:
    """Functional all-reduce (``op``: "sum", "max") of ``t`` over mesh axis ``axis``, waited on."""
    import torch.distributed._functional_collectives as funcol

    return waited(funcol.all_reduce(t, op, (mesh, axis)))


def permute_on_axis(t: torch.Tensor, mesh: DeviceMesh, axis: int, dest: Sequence[int]) -> torch.Tensor:
    """``t`` sent along mesh axis ``axis``: the rank at coordinate ``c`` sends its ``t`` to coordinate ``dest[c]``
    (a permutation) and returns what it receives. Point to point (``permute_tensor``: one all-to-all whose only
    non-empty piece goes to the peer), left asynchronous: it is waited for where it is first read. Under
    ``LocalTensorMode`` the simulated ranks' tensors are exchanged in place of a collective (``permute_tensor``
    there takes one rank's split sizes)."""
    from autoshard._torch_compat.worlds import in_local_tensor_mode

    if not in_local_tensor_mode():
        import torch.distributed._functional_collectives as funcol

        # permute_tensor splits dim 0 by numel: the tensor goes flat
        return funcol.permute_tensor(t.reshape(-1), list(dest), (mesh, axis)).view(t.shape)
    from torch.distributed._local_tensor import local_tensor_mode

    grid = mesh.mesh
    source = {d: c for c, d in enumerate(dest)}
    sender = {}
    for coord in itertools.product(*(range(d) for d in grid.shape)):
        other = list(coord)
        other[axis] = source[coord[axis]]
        sender[int(grid[coord])] = int(grid[tuple(other)])
    per_rank = t._local_tensors  # type: ignore[attr-defined]
    return local_tensor_mode().rank_map(lambda rank: per_rank[sender[rank]].clone())


def swap_mirrored(t: torch.Tensor, mesh: DeviceMesh, axis: int) -> torch.Tensor:
    """``t`` exchanged along mesh axis ``axis`` between coordinates ``c`` and ``n - 1 - c`` (the middle rank of
    an odd axis keeps its own), waited for."""
    n = mesh.size(axis)
    return waited(permute_on_axis(t, mesh, axis, [n - 1 - c for c in range(n)]))


def waited(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor once its functional collective is done: a functional collective's eager result is an
    ``AsyncCollectiveTensor`` (views of it stay asynchronous, and code that reads its storage directly, e.g. a
    compiled program's input or ``torch.save``, would read it unfinished); other tensors as they are."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t
