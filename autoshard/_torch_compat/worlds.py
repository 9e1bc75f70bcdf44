"""Simulated and fake worlds: ``LocalTensorMode``, the fake process group (private torch APIs)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

T = TypeVar("T")


# ------------------------------------------------------------------------------------- local tensor mode


def in_local_tensor_mode() -> bool:
    """True inside ``LocalTensorMode`` (several ranks simulated in this process)."""
    try:
        from torch.distributed._local_tensor import local_tensor_mode
    except ImportError:  # pragma: no cover - older torch
        return False
    return local_tensor_mode() is not None


def outside_local_tensor_mode() -> contextlib.AbstractContextManager:
    """Planning traces plain fake tensors even when the caller simulates ranks with ``LocalTensorMode``."""
    if not in_local_tensor_mode():
        return contextlib.nullcontext()
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
    from torch.utils._python_dispatch import _disable_current_modes

    stack = contextlib.ExitStack()
    stack.enter_context(maybe_disable_local_tensor_mode())
    stack.enter_context(_disable_current_modes())
    return stack


def per_rank_copies(t: torch.Tensor) -> torch.Tensor:
    """Under ``LocalTensorMode``: ``t`` as a local tensor holding one copy per simulated rank. A plain tensor
    there stands for the same value on every rank and has one storage: an in-place update (an optimizer
    step) runs once per rank on it. Outside the mode, ``t`` itself."""
    if not in_local_tensor_mode() or hasattr(t, "_local_tensors"):
        return t
    from torch.distributed._local_tensor import local_tensor_mode

    return local_tensor_mode().rank_map(lambda _rank: t.detach().clone())


def for_each_rank(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` run once per simulated rank under ``LocalTensorMode``, on that rank's tensors and integers (a mesh
    coordinate there is one integer per rank), its results gathered into local tensors; elsewhere ``fn`` itself.
    For rank-dependent shapes (a slice that ends at the rank's own offset). ``fn`` must issue no collective."""
    from torch.distributed._local_tensor import maybe_run_for_local_tensor

    return maybe_run_for_local_tensor(fn)


def fake_process_group(world_size: int) -> None:
    """Initialize a ``fake`` default process group (this process is rank 0): meshes and collective shapes
    work, nothing is communicated."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())


def default_store() -> object | None:
    """The default process group's key-value store (every rank reads and writes the same keys), or None."""
    import torch.distributed.distributed_c10d as c10d

    try:
        return c10d._get_default_store()
    except (RuntimeError, ValueError):  # no default group, or one made without a store
        return None


def abort_process_groups(meshes: Sequence[object] = ()) -> None:
    """End every process group of this process now, closing its connections so that peers waiting in a collective
    fail at once. A group's connections close when its last reference goes: ``destroy_process_group`` drops
    torch's own, and a device mesh also holds its groups (torch 2.13's ``DeviceMesh._pg_registry``, shared by a
    root mesh and its sub-meshes), which is emptied for ``meshes`` (they cannot be used after this anyway)."""
    import gc

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    for mesh in meshes:
        for m in (mesh, getattr(mesh, "_root_mesh", None)):
            registry = getattr(m, "_pg_registry", None)
            if isinstance(registry, dict):
                registry.clear()
    abort = getattr(c10d, "_abort_process_group", None)
    if abort is not None and dist.is_initialized():
        abort()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()  # a group in a reference cycle is freed, and its connections closed, only by the cycle collector


def simulated_ranks(world_size: int) -> contextlib.AbstractContextManager:
    """``LocalTensorMode(world_size)``: ``world_size`` ranks simulated in this process (a process group of that
    size must exist, e.g. ``autoshard.cluster.meshes.fake_world``); the mode is what ``with`` yields."""
    from torch.distributed._local_tensor import LocalTensorMode

    return LocalTensorMode(world_size)


def rank_values(t: torch.Tensor) -> dict[int, torch.Tensor] | None:
    """Under ``LocalTensorMode``: a local tensor's value on each simulated rank, by rank, as plain tensors (read
    them outside the mode, see :func:`outside_local_tensor_mode`); None for an ordinary tensor."""
    per_rank = getattr(t, "_local_tensors", None)
    return dict(per_rank) if per_rank else None


def ranks_disagree(t: torch.Tensor) -> list[int]:
    """Under ``LocalTensorMode``: the simulated ranks whose value of ``t`` differs from the lowest rank's.

    A tensor made inside the mode from a random generator holds a different draw on every rank; used as a
    "global" value it would silently train on different data per rank. Empty for ordinary tensors.
    """
    per_rank = getattr(t, "_local_tensors", None)
    if not per_rank:
        return []
    ranks = sorted(per_rank)
    first = per_rank[ranks[0]]
    return [r for r in ranks[1:] if not torch.equal(per_rank[r], first)]


def detach_from_fake_modes() -> contextlib.AbstractContextManager:
    """Leave any active fake/proxy dispatch modes (used when tracing the lowered program)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()
