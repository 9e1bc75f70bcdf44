"""Taking over a model's parameters: each becomes this rank's shard under the plan's placements.

``distribute_parameters`` replaces each parameter by an ``nn.Parameter`` holding a DTensor (as ``fully_shard``
does), under the model's own names, tied weights kept tied, a meta-device parameter getting only its shard.
``shard_parameters_in_place`` keeps the parameter objects and makes each hold its shard as a plain tensor (the
``torch.compile`` backend's, whose graph guards those objects); ``as_dtensor`` shows such a shard as the DTensor it
is a piece of, and ``clip_grad_norm_`` clips either kind by the whole model's norm.

``take_over`` is the one walk a sharded module (``ShardedModule``, a pipeline stage's ``StageModule``) makes over
its model: buffers built on the meta device made real, every parameter turned into its shard (either way above),
optimizers built before pointed at the new parameters, and what was built on meta watched until values come
(``init_weights``, a checkpoint: ``autoshard/weights/``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import Placement

from autoshard import _torch_compat as tc
from autoshard.errors import InputError
from autoshard.runtime.rebind import rebind_optimizers, retire
from autoshard.weights.shards import Unfilled, drop_stand_in, empty_shard, is_unfilled, materialize_buffers


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (module.get_submodule(path) if path else module), leaf


@dataclass(frozen=True)
class Takeover:
    """What ``take_over`` leaves the sharded module: what awaits values, how to point an optimizer at the new
    parameters now (before loading its state), and how many parameters were built on meta."""

    unfilled: Unfilled
    adopt_optimizer: Callable[[torch.optim.Optimizer], None]
    meta: int


def take_over(
    owner: nn.Module,
    module: nn.Module,
    mesh: DeviceMesh,
    placements: Mapping[str, Sequence[Placement]],
    *,
    host: Collection[str] = (),
    local: bool = False,
) -> Takeover:
    """``module``'s buffers and parameters made this rank's (see the module docstring), for ``owner`` (the sharded
    module, which the optimizers' rebinding hook lives as long as); ``local``: plain tensors holding the shards
    (``shard_parameters_in_place``), else DTensor parameters (``distribute_parameters``, offloaded masters, ``host``,
    in host memory)."""
    meta = {n for n, q in module.named_parameters() if is_unfilled(q)}
    unfilled = Unfilled()
    made = set(materialize_buffers(module, mesh.device_type))
    unfilled.watch((n, b) for n, b in module.named_buffers(remove_duplicate=False) if n in made)
    if local:
        shard_parameters_in_place(module, mesh, placements)
        adopt: Callable[[torch.optim.Optimizer], None] = _nothing
    else:
        adopt = rebind_optimizers(owner, distribute_parameters(module, mesh, placements, host=host))
    unfilled.watch((n, q) for n, q in module.named_parameters() if n in meta)
    return Takeover(unfilled, adopt, len(meta))


def _nothing(optimizer: torch.optim.Optimizer) -> None:
    """(plain tensors: an optimizer built before holds the parameter objects already)"""


def distribute_parameters(
    module: nn.Module, mesh: DeviceMesh, placements: Mapping[str, Sequence[Placement]], host: Collection[str] = ()
) -> dict[int, tuple[nn.Parameter, nn.Parameter]]:
    """Replace every parameter named in ``placements`` by an ``nn.Parameter`` holding a DTensor with those
    placements (a copy of its value), in place, as ``fully_shard`` does; aliases of one parameter (tied weights)
    all get the same new parameter; one on the meta device gets only this rank's shard, uninitialized (in host
    memory if its name is in ``host``: an offloaded master). Returns id(old) -> (old, new); the old objects keep no
    storage (``runtime/rebind.py`` points optimizers built on them at the new ones)."""
    seen: set[int] = set()
    replaced: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
    for name, p in list(module.named_parameters(remove_duplicate=False)):
        if id(p) in seen or name not in placements:
            continue
        seen.add(id(p))
        if p.device.type == "meta":  # built without values: this rank's shard only, filled later (weights/)
            dt = empty_shard(p.shape, p.dtype, mesh, placements[name], host=name in host)
        else:
            dt = distribute_tensor(p.detach().to(mesh.device_type), mesh, placements[name])
        if tc.in_local_tensor_mode() and p.device.type != "meta":
            # simulated ranks of a replicated tensor share one storage: an in-place optimizer step would
            # update it once per rank. Each rank gets its own copy, as each process has on a real group.
            dt = tc.dtensor_like(tc.per_rank_copies(dt.to_local()), dt)
        new = nn.Parameter(dt, requires_grad=p.requires_grad)
        for alias, q in module.named_parameters(remove_duplicate=False):
            if q is p:
                owner, leaf = _owner(module, alias)
                setattr(owner, leaf, new)
        replaced[id(p)] = (p, new)
    for old, _ in replaced.values():
        retire(old)
    return replaced


def shard_parameters_in_place(
    module: nn.Module, mesh: DeviceMesh, placements: Mapping[str, Sequence[Placement]]
) -> None:
    """Keep every parameter object and make it hold this rank's shard (a plain tensor) under ``placements``.
    For the ``torch.compile`` backend: dynamo guards the parameter objects it traced, and an optimizer built
    before the call keeps stepping them (elementwise optimizers are exact on shards; a global gradient norm is
    not: ``ShardedModule.state_dict`` gives DTensors)."""
    seen: set[int] = set()
    for name, p in list(module.named_parameters(remove_duplicate=False)):
        if id(p) in seen or name not in placements:
            continue
        seen.add(id(p))
        if is_unfilled(p):  # built on meta (or its stand-in, traced by dynamo): this rank's shard only
            dt = empty_shard(p.shape, p.dtype, mesh, placements[name])
        else:
            dt = distribute_tensor(p.detach().to(mesh.device_type), mesh, placements[name])
        with torch.no_grad():
            if p.device.type == "meta":  # set_data cannot change a meta tensor's kind: swap the objects' contents
                torch.utils.swap_tensors(p, nn.Parameter(tc.per_rank_copies(dt.to_local()), p.requires_grad))
            else:
                p.data = tc.per_rank_copies(dt.to_local())
                drop_stand_in(p)
        p._autoshard_layout = (mesh, tuple(dt.placements), dt.shape)  # type: ignore[attr-defined]


def as_dtensor(param: torch.Tensor, value: torch.Tensor | None = None) -> DTensor:
    """A parameter held as this rank's shard (``parameters="local"``, the ``torch.compile`` backend), or a
    tensor laid out like it (``value``, e.g. ``param.grad``), as the DTensor it is a piece of:
    ``as_dtensor(p).full_tensor()`` is the whole parameter."""
    layout = getattr(param, "_autoshard_layout", None)
    if layout is None:
        if isinstance(param, DTensor):
            return param if value is None else tc.dtensor_like(value, param)
        raise InputError(
            "as_dtensor takes a parameter autoshard holds as a local shard (parameters='local' or the "
            "torch.compile backend); this one is not"
        )
    mesh, placements, shape = layout
    return DTensor.from_local(
        param.detach() if value is None else value,
        mesh,
        placements,
        run_check=False,
        shape=shape,
        stride=contiguous_strides(shape),
    )


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for sharded parameters, DTensor or held as local shards (the
    ``torch.compile`` backend's): the norm is the whole model's on every rank, not this rank's part."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [as_dtensor(p, p.grad) if hasattr(p, "_autoshard_layout") else p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    total = torch.nn.utils.get_total_norm(grads, norm_type)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.device) if not isinstance(p.grad, DTensor) else coef.item())
    return total


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(tuple(shape)):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))
