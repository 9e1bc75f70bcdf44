"""Functional collectives as autoshard issues them: one collective over several mesh axes (a flattened mesh),
the ``*_single`` names where torch has them (``*_tensor`` on torch 2.11), and waiting on an eager result."""

from __future__ import annotations

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


def waited(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor once its functional collective is done: a functional collective's eager result is an
    ``AsyncCollectiveTensor`` (views of it stay asynchronous, and code that reads its storage directly, e.g. a
    compiled program's input or ``torch.save``, would read it unfinished); other tensors as they are."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t
