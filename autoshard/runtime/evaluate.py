"""Evaluation: the model's forward alone, returning every output, on the shards the training program holds.

A validation loop calls the compiled module in ``eval()`` mode or under ``torch.no_grad()``; what it needs back
is the model's output (logits for accuracy, per-token losses, a few greedy tokens), not only the loss. The
training program computes the loss alone, so an evaluation call runs a second program: the model traced in its
current mode (dropout off, BatchNorm reading its running statistics) keeping every tensor it returns, planned
with each parameter pinned to the layout the training program computes with (no parameter moves) and the batch
split over the data-parallel axes, and lowered like a training program; only its forward ever runs (nothing is
saved for a backward). One program per call shape, planned at the first call of that shape.

The call takes this rank's pieces, cut as ``compile(model, mesh)`` without example inputs takes them: dim 0
over the data-parallel axes, whole elsewhere (``ShardedModule.shard_inputs`` cuts a global call so in eval
mode). The outputs come back whole on every rank (gathered), in the model's own structure (a ``ModelOutput``,
tuple or tensor); values that are not tensors (a KV cache object) come back as ``None``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement

from autoshard import _torch_compat as tc
from autoshard.inputs import Call, signature_of
from autoshard.messages import warn
from autoshard.plans.plan import Plan
from autoshard.runtime.lazy import batch_constraint, global_example
from autoshard.runtime.param_state import ParamStates
from autoshard.runtime.program import StageProgram

log = logging.getLogger(__name__)

# (model to trace, global example call, constraints) -> (the planned Plan, this rank's program)
PlanEval = Callable[[nn.Module, Call, Mapping[str, Any]], tuple[Plan, StageProgram]]


@dataclass(frozen=True)
class _Masters:
    """A program's layouts as ``ParamStates`` reads them, with the masters held as the training program holds
    them (ZeRO's further-sharded masters, offloaded ones): its compute copies are gathered from those."""

    layouts: Mapping[str, tuple[Placement, ...]]
    state_layouts: Mapping[str, tuple[Placement, ...]]
    offload: Mapping[str, str]

    @property
    def grad_layouts(self) -> Mapping[str, tuple[Placement, ...]]:
        return self.layouts


@dataclass
class _EvalProgram:
    program: StageProgram
    states: ParamStates
    params: list[str]
    buffers: list[str]
    spec: Any  # the pytree spec of the model's output
    tensor_leaves: list[int]  # which leaves of the output are the program's outputs, in order


class _FlatOutputs(nn.Module):
    """The model itself (same parameters, same names), returning the tensors of its output as a flat tuple."""

    def __init__(self, model: nn.Module, record: Callable[[Any, list[int]], None]) -> None:
        super().__init__()
        self.model = model
        self._record = record

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        out = self.model(*args, **kwargs)
        leaves, spec = tc.tree_flatten(out)
        keep = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        self._record(spec, keep)
        return tuple(leaves[i] for i in keep)


class Evaluator:
    """The evaluation programs of one compiled model, by call shape."""

    def __init__(
        self,
        model: nn.Module,
        mesh: DeviceMesh,
        compute: Mapping[str, tuple[Placement, ...]],
        masters: Mapping[str, tuple[Placement, ...]],
        offload: Mapping[str, str],
        plan_eval: PlanEval,
        view: Callable[[], nn.Module],
    ) -> None:
        self.model = model
        self._view = view  # the model with every parameter at its global shape (held as local shards or not)
        self.mesh = mesh
        self._compute = dict(compute)
        self._masters = dict(masters)
        self._offload = dict(offload)
        self._plan_eval = plan_eval
        self._programs: dict[tuple, _EvalProgram] = {}
        self._warned: set[str] = set()

    def __call__(self, args: tuple, kwargs: dict[str, Any], axes: Sequence[int] | None = None) -> Any:
        """The output for this rank's pieces (dim 0 split over the batch ``axes``, default the data-parallel
        ones)."""
        signature, pieces = signature_of(Call(tuple(args), dict(kwargs)))
        key = (signature.names, tuple((tuple(t.shape), t.dtype) for t in pieces))
        ev = self._programs.get(key)
        if ev is None:
            ev = self._programs[key] = self._build(args, kwargs, axes)
        params = dict(self.model.named_parameters(remove_duplicate=False))
        bufs = dict(self.model.named_buffers(remove_duplicate=False))
        flat = [params[n] for n in ev.params] + [bufs[n] for n in ev.buffers] + list(pieces)
        with torch.no_grad():
            outs, _ = ev.program.forward_many(ev.states.local_inputs(flat))
        leaves: list[Any] = [None] * ev.spec.num_leaves
        for i, value in zip(ev.tensor_leaves, outs):
            leaves[i] = value
        return tc.tree_unflatten(leaves, ev.spec)

    def _build(self, args: tuple, kwargs: dict[str, Any], axes: Sequence[int] | None) -> _EvalProgram:
        seen: dict[str, Any] = {}

        def record(spec: Any, keep: list[int]) -> None:
            seen["spec"], seen["keep"] = spec, keep

        wrapper = _FlatOutputs(self._view(), record)
        example = global_example(args, kwargs, self.mesh, axes)
        pins: dict[str, Any] = {**batch_constraint(self.mesh, example, axes)}
        pins.update({f"model.{n}": p for n, p in self._compute.items()})
        with torch.enable_grad():
            plan, program = self._plan_eval(wrapper, example, pins)
        names = [t.name for t in plan.stages[0].tensors if t.role == "parameter"]
        buffers = [t.name for t in plan.stages[0].tensors if t.role == "buffer"]
        params = [n.removeprefix("model.") for n in names]
        layouts = {n.removeprefix("model."): p for n, p in program.layouts.items()}
        states = ParamStates(
            self.mesh,
            params,
            _Masters(layouts, {n: self._masters[n] for n in params}, {n: self._offload.get(n, "") for n in params}),
        )
        spec, keep = seen["spec"], seen["keep"]
        dropped = [i for i in range(spec.num_leaves) if i not in set(keep)]
        if dropped and "dropped" not in self._warned:
            self._warned.add("dropped")
            warn(
                log,
                "evaluation: %d values of %s's output are not tensors (a cache object, ...) and come back as None",
                len(dropped),
                type(self.model).__name__,
            )
        log.info(
            "evaluation: planned %s for %s",
            type(self.model).__name__,
            ", ".join(f"{tuple(t.shape)}" for t in signature_of(Call(tuple(args), dict(kwargs)))[1]),
        )
        return _EvalProgram(program, states, params, [b.removeprefix("model.") for b in buffers], spec, keep)
