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
from autoshard.errors import InputError, UsageError

log = logging.getLogger(__name__)


def empty_shard(
    shape: Sequence[int], dtype: torch.dtype, mesh: DeviceMesh, placements: Sequence[Placement], host: bool = False
) -> DTensor:
    """A DTensor of global ``shape`` whose local tensor is this rank's shard only, uninitialized; ``host``: its
    local tensor in host memory (pinned beside a GPU), as an offloaded master is held, never on the device."""
    if host:
        cut = distribute_tensor(
            torch.empty(tuple(shape), dtype=dtype, device="meta"), mesh, tuple(placements), src_data_rank=None
        )
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
        raise InputError(
            f"a whole tensor of shape {tuple(full.shape)} cannot fill one of shape {tuple(global_shape(target))}"
        )
    if layout is None:
        target.copy_(full)
        return
    mesh, placements, _ = layout
    piece = distribute_tensor(full.to(mesh.device_type), mesh, placements, src_data_rank=None)
    local_of(target).copy_(piece.to_local())


def materialize_buffers(module: nn.Module, device: str | torch.device) -> list[str]:
    """Give every buffer on the meta device (or standing in for one) real (uninitialized) storage on ``device``,
    aliases kept; returns their names."""
    made: dict[int, torch.Tensor] = {}
    names = []
    for owner_name, owner in module.named_modules(remove_duplicate=False):
        for leaf, b in list(owner._buffers.items()):
            if b is None or not is_unfilled(b):
                continue
            if id(b) not in made:
                made[id(b)] = torch.empty(b.shape, dtype=b.dtype, device=device)
                names.append(f"{owner_name}.{leaf}" if owner_name else leaf)
            owner._buffers[leaf] = made[id(b)]
    return names


_STAND_IN = "_autoshard_stand_in"


def stand_in_device() -> torch.device | None:
    """Where a meta model's stand-ins go: the default process group's device (CUDA under NCCL), None without one."""
    if not torch.distributed.is_initialized():
        return None
    if "nccl" in str(torch.distributed.get_backend()) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def is_unfilled(t: torch.Tensor) -> bool:
    """Built on the meta device and not given storage yet (a meta tensor, or a stand-in for one)."""
    return t.device.type == "meta" or getattr(t, _STAND_IN, False)


def stand_in_for_meta(module: nn.Module, device: torch.device) -> int:
    """Make every meta parameter and buffer of ``module`` a one-element tensor expanded to its shape on ``device``
    (same object, same shape and dtype; a few bytes each): what dynamo needs to trace the model on the inputs'
    device before ``torch.compile(model, backend="autoshard")`` plans it. :func:`restore_meta` undoes it; the
    number made is returned."""
    made: dict[int, torch.Tensor] = {}
    for p in module.parameters():
        if p.device.type == "meta" and id(p) not in made:
            made[id(p)] = p
            with torch.no_grad():
                torch.utils.swap_tensors(p, nn.Parameter(_stand_in(p, device), p.requires_grad))
            setattr(p, _STAND_IN, True)
    for owner in module.modules():
        for leaf, b in list(owner._buffers.items()):
            if b is not None and b.device.type == "meta":
                if id(b) not in made:
                    made[id(b)] = _stand_in(b, device)
                    setattr(made[id(b)], _STAND_IN, True)
                owner._buffers[leaf] = made[id(b)]
    return len(made)


def restore_meta(module: nn.Module) -> int:
    """Put the meta tensors back where :func:`stand_in_for_meta` left stand-ins (parameter objects kept); returns
    how many."""
    done: dict[int, torch.Tensor] = {}
    for p in module.parameters():
        if getattr(p, _STAND_IN, False) and id(p) not in done:
            done[id(p)] = p
            with torch.no_grad():
                # (swap_tensors swaps the attribute dicts too: the marker leaves with the stand-in)
                torch.utils.swap_tensors(
                    p, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad)
                )
    for owner in module.modules():
        for leaf, b in list(owner._buffers.items()):
            if b is not None and getattr(b, _STAND_IN, False):
                if id(b) not in done:
                    done[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="meta")
                owner._buffers[leaf] = done[id(b)]
    return len(done)


def drop_stand_in(t: torch.Tensor) -> None:
    """``t`` (a stand-in's object) holds real storage now."""
    if getattr(t, _STAND_IN, False):
        delattr(t, _STAND_IN)


def _stand_in(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.zeros((), dtype=t.dtype, device=device).expand(t.shape)


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

    def mark_filled(self, names: Iterable[str]) -> None:
        """These were written in a way their version counters do not show (through a DTensor view of a shard)."""
        done = set(names)
        self._watched = [w for w in self._watched if w.name not in done]

    def missing(self) -> list[str]:
        self._watched = [w for w in self._watched if w.tensor is not None and _versions(w.tensor) == w.versions]
        return [w.name for w in self._watched]

    def check_after(self, call: str, source: str) -> None:
        """After ``call`` filled the model: what it did not write is an error naming the tensors."""
        left = self.missing()
        if left:
            shown = ", ".join(left[:6]) + (f" and {len(left) - 6} more" if len(left) > 6 else "")
            raise UsageError(
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
            raise UsageError(
                f"{len(left)} tensors of this model were built on the meta device and still have no values "
                f"({shown}). Before the first step, give them values: sharded.init_weights(seed=0) (the model's "
                "own initialization, on the shards), sharded.load_pretrained(path) (a save_pretrained directory), "
                "or dcp.load(sharded.state_dict(), ...) / set_model_state_dict(sharded, ...)."
            )


__all__ = ["Unfilled", "empty_shard", "global_shape", "layout_of", "local_of", "materialize_buffers", "write_full"]
