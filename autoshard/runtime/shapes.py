"""A compiled module's programs by input shape: batches whose shape changes in a training loop.

Real loaders pad each batch to its longest sequence and end with a short batch, so one program for one shape is
not enough. A call whose local input shapes the module has not met is planned at its first call for its global
shapes (the local ones scaled by the mesh axes each input is split over), with the first plan's choices replayed
(``compiler/solve_reuse.py``: no integer program solved) or, where one no longer holds at these shapes, solved with
every parameter and input pinned to its layout; the program is kept for the next batch of that shape. Parameters
never move: the module's shards, optimizer state and input cuts stay as compiled.

Every rank must meet the same shape at the same step (the planning is collective): the first call of a new shape
checks that every rank holds an even piece of one batch, and a batch the ranks cannot split evenly is refused with
what to do (``drop_last=True``, a divisible batch) before anything runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement

from autoshard.errors import InputError, InternalError
from autoshard.inputs import Call, CallSignature
from autoshard.plans.plan import Plan, TensorLayout
from autoshard.runtime.program import Program

log = logging.getLogger(__name__)

# (model at global shapes, global example call of new shapes, constraints pinning the parameters and inputs) ->
# (its Plan, this rank's program, how it was planned, e.g. "layouts reused: capture 1.2 s, ...")
PlanShapes = Callable[[nn.Module, Call, Mapping[str, Any]], tuple[Plan, Program, str]]


class ShapePrograms:
    """The programs of one compiled module by local input shapes (the first: compile's own)."""

    def __init__(
        self,
        mesh: DeviceMesh,
        plan: Plan,
        program: Program,
        inputs: list[TensorLayout],
        layouts: Mapping[str, tuple[Placement, ...]],
        param_names: Sequence[str],
        signature: CallSignature,
        plan_shapes: PlanShapes,
        view: Callable[[], nn.Module],
        label: Callable[[str], str],
    ) -> None:
        self.mesh = mesh
        self.plan = plan
        self._layouts = layouts
        self._params = list(param_names)
        self._signature = signature
        self._plan_shapes = plan_shapes
        self._view = view  # the model with every parameter at its global shape
        self._label = label  # "input_ids (input[0])"
        first = tuple(tuple(t.local_shape(plan.mesh)) for t in inputs)
        self.programs: dict[tuple, tuple[Any, list[TensorLayout]]] = {first: (program, inputs)}

    def program_for(
        self, tensors: Sequence[Any], current: Sequence[Sequence[int]]
    ) -> tuple[Program, list[TensorLayout]] | None:
        """(program, its input layouts) for these local input tensors; None when the current program fits them,
        or when they are not plain tensors of the traced ranks (the caller's input checks name what is wrong)."""
        if not all(isinstance(t, torch.Tensor) and type(t) is torch.Tensor for t in tensors):
            return None
        shapes = tuple(tuple(t.shape) for t in tensors)
        if shapes == tuple(tuple(s) for s in current) or any(len(a) != len(b) for a, b in zip(shapes, current)):
            return None
        if shapes not in self.programs:
            self.programs[shapes] = self._plan(tensors, shapes)
        return self.programs[shapes]

    def _plan(self, tensors: Sequence[torch.Tensor], shapes: tuple) -> tuple[Any, list[TensorLayout]]:
        inputs = sorted((t for t in self.plan.stages[0].tensors if t.role == "input"), key=lambda t: int(t.name[6:-1]))
        self._check_even(shapes, inputs)
        whole = []
        for t, layout in zip(tensors, inputs):
            shape = list(t.shape)
            for axis, p in enumerate(self._layouts[layout.name]):
                if isinstance(p, Shard):
                    shape[p.dim] *= self.mesh.size(axis)
            whole.append(torch.empty(shape, dtype=t.dtype, device="meta"))
        call_args, call_kwargs = self._signature.unflatten(whole)
        pins = {t.name: t.placements for t in self.plan.stages[0].tensors if t.role in ("parameter", "input")}
        started = time.perf_counter()
        plan, program, how = self._plan_shapes(self._view(), Call(tuple(call_args), dict(call_kwargs)), pins)
        moved = [n for n in self._params if tuple(program.layouts[n]) != tuple(self._layouts[n])]
        if moved:
            raise InternalError(
                f"the plan for input shapes {shapes} lays out parameters {moved[:3]} otherwise than "
                "the first plan; this is a bug in autoshard's re-planning"
            )
        planned = sorted((t for t in plan.stages[0].tensors if t.role == "input"), key=lambda t: int(t.name[6:-1]))
        log.info(
            "compile: new input shapes %s planned in %.1f s (%s); %d shapes kept",
            list(shapes),
            time.perf_counter() - started,
            how,
            len(self.programs) + 1,
        )
        return program, planned

    def _check_even(self, shapes: tuple, inputs: Sequence[TensorLayout]) -> None:
        """Every rank meets this shape now, with an even piece of one batch; else an error on every rank."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return
        seen: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(seen, shapes)
        for r, other in enumerate(seen):
            if other != shapes:
                i = next(k for k, (a, b) in enumerate(zip(shapes, other)) if a != b)
                raise InputError(
                    f"{self._label(inputs[i].name)}: this rank's piece is {shapes[i]} and rank {r}'s {other[i]}: the "
                    f"batch does not split evenly over the mesh {self.plan.mesh} (e.g. a last batch smaller than the "
                    "data-parallel size times the per-rank batch). Keep every batch divisible "
                    "(DataLoader(drop_last=True), or pad the last batch)"
                )
