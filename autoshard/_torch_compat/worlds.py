"""Simulated and fake worlds: ``LocalTensorMode``, the fake process group (private torch APIs)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
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
