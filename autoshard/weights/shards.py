"""This rank's shards of a model's tensors: allocated without the whole tensor, written from a whole one, and
watched until every tensor built on the meta device has been given values.

A parameter is held in one of two ways after ``compile``: an ``nn.Parameter`` holding a DTensor (its shard is
the DTensor's local tensor), or a plain parameter holding this rank's shard with its layout recorded on it
(``_autoshard_layout = (mesh, placements, global shape)``, ``parameters="local"`` and the ``torch.compile``
backend). Buffers stay whole, plain tensors on every rank.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor import empty as dtensor_empty
from torch.distributed.tensor.placement_types import Placement

from autoshard import _torch_compat as tc
from autoshard.errors import InputError

log = logging.getLogger(__name__)


def empty_shard(shape: Sequence[int], dtype: torch.dtype, mesh: DeviceMesh, placements: Sequence[Placement],
                host: bool = False) -> DTensor:
    """A DTensor of global ``shape`` whose local tensor is this rank's shard only, uninitialized; ``host``: its
    local tensor in host memory (pinned beside a GPU), as an offloaded master is held, never on the device."""
    if host:
        cut = distribute_tensor(torch.empty(tuple(shape), dtype=dtype, device="meta"), mesh, tuple(placements),
                                src_data_rank=None)
        local = torch.empty(cut.to_local().shape, dtype=dtype, device="cpu", pin_memory=mesh.device_type == "cuda")
        return tc.dtensor_like(local, cut)  # (from_local would move the local tensor to the mesh's device)
    dt = dtensor_empty(*shape, dtype=dtype, device_mesh=mesh, placements=tuple(placements))
    if tc.in_local_tensor_mode():  # one storage per simulated rank, as each process has its own
        dt = tc.dtensor_like(tc.per_rank_copies(dt.to_local()), dt)
    return dt


def layout_of(t: torch.Tensor) -> tuple[DeviceMesh, tuple[Placement, ...], torch.Size] | None:
    """(mesh, placements, global shape) of a sharded tensor: a DTensor, or a plain parameter holding its shard;
    None for a whole tensor."""
    if isinstance(t, DTensor):
        return t.device_mesh, tuple(t.placements), t.shape
    layout = getattr(t, "_autoshard_layout", None)
    if layout is not None:
        mesh, placements, shape = layout
        return mesh, tuple(placements), torch.Size(shape)
    return None


def global_shape(t: torch.Tensor) -> torch.Size:
    layout = layout_of(t)
    return layout[2] if layout is not None else t.shape


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor that holds this rank's values of ``t`` (its shard, or ``t`` itself)."""
    return tc.local_tensor(t)


@torch.no_grad()
def write_full(target: torch.Tensor, full: torch.Tensor) -> None:
    """Write this rank's piece of the whole tensor ``full`` (equal on every rank) into ``target``'s shard,
    casting to its dtype; no communication."""
    layout = layout_of(target)
    if tuple(full.shape) != tuple(global_shape(target)):
        raise InputError(f"a whole tensor of shape {tuple(full.shape)} cannot fill one of shape "
                         f"{tuple(global_shape(target))}")
    if layout is None:
        target.copy_(full)
        return
    mesh, placements, _ = layout
    piece = distribute_tensor(full.to(mesh.device_type), mesh, placements, src_data_rank=None)
    local_of(target).copy_(piece.to_local())


def materialize_buffers(module: nn.Module, device: str | torch.device) -> list[str]:
    """Give every buffer on the meta device real (uninitialized) storage on ``device``, aliases kept; returns
    their names."""
    made: dict[int, torch.Tensor] = {}
    names = []
    for owner_name, owner in module.named_modules(remove_duplicate=False):
        for leaf, b in list(owner._buffers.items()):
            if b is None or b.device.type != "meta":
                continue
            if id(b) not in made:
                made[id(b)] = torch.empty(b.shape, dtype=b.dtype, device=device)
                names.append(f"{owner_name}.{leaf}" if owner_name else leaf)
            owner._buffers[leaf] = made[id(b)]
    return names


@dataclass(frozen=True)
class _Watched:
    name: str
    ref: weakref.ref  # not a reference: swap_tensors (offload's move to the host) refuses tensors held elsewhere
    versions: tuple[int, int]

    @property
    def tensor(self) -> torch.Tensor | None:
        return self.ref()


def _versions(t: torch.Tensor) -> tuple[int, int]:
    # a DTensor written through DTensor ops bumps its own counter; a write to its local tensor (DCP's loads, a
    # shard cut into place) bumps only the local one
    return t._version, local_of(t)._version


class Unfilled:
    """The tensors that were built on the meta device and have not been written since they were allocated:
    ``check`` raises before a step would read their garbage."""

    def __init__(self) -> None:
        self._watched: list[_Watched] = []

    def watch(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._watched += [_Watched(n, weakref.ref(t), _versions(t)) for n, t in named]

    def missing(self) -> list[str]:
        self._watched = [w for w in self._watched if w.tensor is not None and _versions(w.tensor) == w.versions]
        return [w.name for w in self._watched]

    def check_after(self, call: str, source: str) -> None:
        """After ``call`` filled the model: what it did not write is an error naming the tensors."""
        left = self.missing()
        if left:
            shown = ", ".join(left[:6]) + (f" and {len(left) - 6} more" if len(left) > 6 else "")
            raise RuntimeError(
                f"{call} ({source}) left {len(left)} tensors built on the meta device without values: {shown}. "
                "Nothing in the model's initialization or the checkpoint writes them: build the modules that "
                "own them on a real device, give those modules a reset_parameters(), or load them from a checkpoint."
            )

    def check(self) -> None:
        if not self._watched:
            return
        left = self.missing()
        if left:
            shown = ", ".join(left[:4]) + (f" and {len(left) - 4} more" if len(left) > 4 else "")
            raise RuntimeError(
                f"{len(left)} tensors of this model were built on the meta device and still have no values "
                f"({shown}). Before the first step, give them values: sharded.init_weights(seed=0) (the model's "
                "own initialization, on the shards), sharded.load_pretrained(path) (a save_pretrained directory), "
                "or dcp.load(sharded.state_dict(), ...) / set_model_state_dict(sharded, ...)."
            )


__all__ = ["Unfilled", "empty_shard", "global_shape", "layout_of", "local_of", "materialize_buffers", "write_full"]
