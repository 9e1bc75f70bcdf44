"""This rank's pieces of a call: global-shaped inputs cut by the plan's placements, and the local ones checked.

``ShardedModule.shard_inputs`` cuts a global-shaped call (every rank passes the same values) into the pieces this
rank's program takes, by the placements the plan gave each input tensor; ``ShardedModule.forward`` checks the
pieces it is given against the shapes and dtypes the program was compiled for. Both name a tensor by its place in
the call and in the plan (``label``: ``attention_mask (input[1])``), and say what to do about a wrong one.

A call's pieces are one value, :class:`Pieces` (positional and keyword tensors), shaped back for the user as the
call was made (``Pieces.shaped``: a tuple for ``sharded(*pieces)``, a dict for ``sharded(**pieces)``, both as
``(args, kwargs)``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from autoshard import _torch_compat as tc
from autoshard.errors import CallError, InputError
from autoshard.inputs import CallSignature
from autoshard.notation import placements_str, tensor_str
from autoshard.plans.plan import MeshSpec, TensorLayout


@dataclass(frozen=True)
class Pieces:
    """This rank's pieces of one call: its positional and keyword tensors (and any other values, as given)."""

    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def shaped(self) -> Any:
        """As ``shard_inputs`` returns them: a tuple, a dict, or ``(args, kwargs)`` when the call had both."""
        if not self.kwargs:
            return self.args
        return self.kwargs if not self.args else (self.args, self.kwargs)

    def call(self, fn: Callable[..., Any]) -> Any:
        return fn(*self.args, **self.kwargs)


def my_piece(t: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> torch.Tensor | None:
    """This rank's piece of the global ``t`` under Shard/Replicate ``placements``, cut directly (a view per
    axis, outer axis first, as DTensor nests its shards): what ``redistribute`` from Replicate gives, without its
    per-call dispatch. None where DTensor must do it: under ``LocalTensorMode`` (no one rank), or a dim that
    does not split evenly (DTensor's padding rules)."""
    coord = None if tc.in_local_tensor_mode() else mesh.get_coordinate()
    if coord is None:
        return None
    piece = t
    for axis, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        n = mesh.size(axis)
        if not isinstance(p, Shard) or piece.shape[p.dim] % n:
            return None
        piece = piece.narrow(p.dim, coord[axis] * (piece.shape[p.dim] // n), piece.shape[p.dim] // n)
    return piece.contiguous()


def cut(t: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> torch.Tensor:
    """This rank's piece of the global ``t`` under ``placements``."""
    t = t.to(mesh.device_type)
    piece = my_piece(t, mesh, placements)
    if piece is None:  # simulated ranks, or an uneven split: DTensor cuts it
        whole = DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)
        piece = whole.redistribute(mesh, placements).to_local()
    return piece


def label(signature: CallSignature, name: str) -> str:
    """``attention_mask (input[1])``: the argument's place in the call and its name in the plan."""
    i = int(name[len("input[") : -1])
    arg = signature.names[i] if i < len(signature.names) else ""
    return f"{arg} ({name})" if arg and arg != f"args[{i}]" else name


def global_pieces(
    tensors: Sequence[torch.Tensor],
    inputs: Sequence[TensorLayout],
    layouts: dict[str, tuple[Placement, ...]],
    mesh: DeviceMesh,
    signature: CallSignature,
    plan_mesh: MeshSpec,
    any_shape: bool,
) -> Pieces:
    """This rank's pieces of the global ``tensors`` of a call (flattened by ``signature``), each checked against
    its input of the plan (``inputs``, placed by ``layouts``); ``any_shape``: the module plans other shapes too
    (``runtime/shapes.py``), so only the rank of each tensor must match."""
    out = []
    for t, layout in zip(tensors, inputs):
        name = label(signature, layout.name)
        if t.ndim != len(layout.shape) or (not any_shape and tuple(t.shape) != tuple(layout.shape)):
            raise InputError(
                f"{name}: expected global shape {tensor_str(layout.dtype, layout.shape)}, got {tuple(t.shape)}"
            )
        bad = tc.ranks_disagree(t)
        if bad:
            raise InputError(
                f"{name}: shard_inputs takes the global value, equal on every rank, but simulated ranks {bad} hold "
                "different values than rank 0 (a tensor drawn from a random generator inside LocalTensorMode "
                "differs per rank). Make the global inputs before entering LocalTensorMode."
            )
        for axis, p in enumerate(layouts[layout.name]):
            if isinstance(p, Shard) and t.shape[p.dim] % mesh.size(axis):
                raise InputError(
                    f"{name}: dim {p.dim} of {tuple(t.shape)} does not split evenly over the {mesh.size(axis)} ranks "
                    f"of mesh axis {axis} ({plan_mesh}), e.g. a last batch smaller than the others. Keep every batch "
                    "divisible (DataLoader(drop_last=True), or pad the last batch)"
                )
        out.append(cut(t, mesh, layouts[layout.name]))
    return Pieces(*signature.unflatten(out))


def batch_pieces(mesh: DeviceMesh, axes: Sequence[int], args: tuple, kwargs: dict[str, Any]) -> Pieces:
    """This rank's pieces of any call with every tensor split on dim 0 over the mesh ``axes`` (evaluation's)."""
    from autoshard.inputs import Call, signature_of

    batch = [Shard(0) if a in axes else Replicate() for a in range(mesh.ndim)]
    signature, tensors = signature_of(Call(args, kwargs))
    return Pieces(*signature.unflatten([cut(t, mesh, batch) for t in tensors]))


def check_local(
    args: Sequence[Any],
    inputs: Sequence[TensorLayout],
    shapes: Sequence[tuple[int, ...]],
    signature: CallSignature,
    plan_mesh: MeshSpec,
) -> None:
    """The local pieces a call passes against what the program takes: as many, plain tensors (not DTensors), each
    of its local ``shapes`` and dtype."""
    if len(args) != len(inputs):
        raise CallError(
            f"the sharded module takes {len(inputs)} local input tensors (as the plan was traced), got {len(args)}"
        )
    for a, layout, shape in zip(args, inputs, shapes):
        name = label(signature, layout.name)
        if not isinstance(a, torch.Tensor):
            raise CallError(f"{name}: expected a tensor, got {type(a).__name__}")
        if isinstance(a, DTensor):
            raise CallError(f"{name}: pass this rank's local tensor (use sharded.shard_inputs), not a DTensor")
        if tuple(a.shape) != tuple(shape) or str(a.dtype).replace("torch.", "") != layout.dtype:
            raise InputError(
                f"{name}: expected this rank's local piece {tensor_str(layout.dtype, shape)} (global "
                f"{tensor_str(layout.dtype, layout.shape)} placed {placements_str(layout.placements)} on mesh "
                f"{plan_mesh}), got {tensor_str(a.dtype, tuple(a.shape))}. sharded.shard_inputs(*global) returns "
                "the right pieces."
            )


__all__ = ["Pieces", "batch_pieces", "check_local", "cut", "global_pieces", "label", "my_piece"]
