"""One pipeline stage on this rank: its compiled program run under autograd (part of ``runtime/pipelined.py``).

``StageModule.forward(*received, **model_inputs)`` takes the global-shaped values a stage receives and the model
inputs of its micro-batch, and returns what the stage sends on (the last stage: its loss); ``_RunStage`` runs the
stage program's forward and, on autograd's backward, its backward from the outputs' gradients, returning the
parameters' and the received activations' gradients (under a zero-bubble schedule the input part only, the
weights' part queued: ``runtime/deferred_weights.py``). The parameters are DTensors with the stage plan's
placements, under the model's own names. ``draw_list`` reads the random draws a stage's forward makes, for the
pipeline's random streams (``runtime/stage_random.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from autoshard.errors import CallError
from autoshard.plans.plan import Plan
from autoshard.rules import random_draws
from autoshard.runtime.deferred_weights import DeferredWeights
from autoshard.runtime.param_state import ParamStates, scatter_grads
from autoshard.runtime.param_takeover import take_over
from autoshard.runtime.program import StageProgram
from autoshard.runtime.stage_random import ReplayStreams, StageStreams
from autoshard.runtime.stage_values import StageWiring, stage_args, stage_sends


class _RunStage(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        program: StageProgram,
        grad_slots: tuple[int, ...],
        states: ParamStates,
        deferred: DeferredWeights | None,
        *flat: torch.Tensor,
    ) -> Any:
        outs, saved = program.forward_many(states.local_inputs(flat))
        ctx.program, ctx.saved, ctx.grad_slots, ctx.states = program, saved, grad_slots, states
        ctx.deferred, ctx.flat = deferred, (flat if deferred is not None else None)
        ctx.like = [x if isinstance(x, DTensor) else None for x in flat]
        ctx.out_meta = [(o.shape, o.dtype, o.device) for o in outs]
        # outputs with no tangent in the captured program (tables derived from buffers, integer tensors) carry
        # no gradient: say so, so that pipelining neither waits for nor sends one
        with_grad = set(program.tangent_of)
        ctx.mark_non_differentiable(*[o for i, o in enumerate(outs) if i not in with_grad])
        return tuple(outs) if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx: Any, *grad_outs: torch.Tensor | None) -> tuple:
        grads_in = [
            g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
            for g, (shape, dtype, device) in zip(grad_outs, ctx.out_meta)
        ]
        if ctx.deferred is not None:  # a zero-bubble schedule: the weights' part later (``dw_builder``)
            grads = ctx.deferred.input_backward(ctx.saved, grads_in, ctx.flat, ctx.like, ctx.states)
            ctx.saved = ctx.flat = None
            return (None, None, None, None, *grads)
        grads = ctx.program.backward_many(ctx.saved, grads_in)
        ctx.saved = None
        return (None, None, None, None, *scatter_grads(grads, ctx.grad_slots, ctx.like, ctx.states))


def input_key(i: int) -> str:
    """The keyword under which the schedule hands model input ``i`` (its micro-batch) to every stage."""
    return f"autoshard_input_{i}"


class StageModule(nn.Module):
    """One pipeline stage on this rank: ``forward(*received, **model_inputs)`` with global-shaped micro-batch
    tensors returns what the stage sends on (the last stage: its loss). ``wiring`` says which of the stage
    graph's arguments are received values and which are model inputs, and which received values it relays."""

    def __init__(
        self,
        module: nn.Module,
        mesh: DeviceMesh,
        plan: Plan,
        program: StageProgram,
        grad_names: Sequence[str],
        wiring: StageWiring,
    ) -> None:
        super().__init__()
        self.module = module
        self.plan = plan
        self.program = program
        self._mesh = mesh
        self._wiring = wiring
        stage = plan.stages[0]
        self._param_names = [t.name for t in stage.tensors if t.role == "parameter"]
        layouts = program.layouts  # Placement objects by name, from the planned graph
        self._states = ParamStates(mesh, self._param_names, program)
        taken = take_over(self, module, mesh, self._states.master_placements(), host=self._states.offloaded())
        self._unfilled = taken.unfilled  # built on meta: filled by PipelinedModule.init_weights / load_pretrained
        self._buffer_names = [t.name for t in stage.tensors if t.role == "buffer"]
        inputs = sorted((t for t in stage.tensors if t.role == "input"), key=lambda t: int(t.name[6:-1]))
        self._input_placements = [layouts[t.name] for t in inputs]
        slot = {n: i for i, n in enumerate(self._param_names)}
        base = len(self._param_names) + len(self._buffer_names)
        slot.update({f"input[{i}]": base + i for i in range(len(inputs))})
        self._grad_slots = tuple(slot[n] for n in grad_names)
        self._first_input_slot = base
        self._deferred: DeferredWeights | None = None
        self._streams: StageStreams | ReplayStreams | None = None  # its random stream (``runtime/stage_random.py``)
        self._index = 0  # its index in the pipeline (set by PipelinedModule)

    def defer_weights(self) -> Callable[[], Callable[[], None]]:
        """Run this stage's backward in two parts from now on (zero-bubble schedules); the stage's
        ``dw_builder`` (``runtime/deferred_weights.py``)."""
        self._deferred = DeferredWeights(self.program, self._grad_slots, self._first_input_slot)
        return self._deferred.runner

    def _fqn_modifiers(self) -> dict[str, str]:
        return {"module": "module"}  # names are the model's (``PipelinedModule._fqn_modifiers``)

    def _local(self, x: torch.Tensor, placements: Sequence[Any]) -> torch.Tensor:
        if all(isinstance(p, Replicate) for p in placements):
            return x  # whole on every rank: no slicing, and autograd reaches the received buffer directly
        rep = [Replicate()] * self._mesh.ndim
        return DTensor.from_local(x, self._mesh, rep, run_check=False).redistribute(self._mesh, placements).to_local()

    def forward(self, *received: torch.Tensor, **model_inputs: torch.Tensor) -> Any:
        if len(received) != self._wiring.received:
            raise CallError(f"pipeline stage receives {self._wiring.received} tensors, got {len(received)}")
        inputs = {i: model_inputs[input_key(i)] for kind, i in self._wiring.args if kind == "input"}
        args = stage_args(self._wiring, received, inputs)
        params = dict(self.module.named_parameters(remove_duplicate=False))
        flat = [params[n] for n in self._param_names]  # DTensors: _RunStage takes their local shards
        bufs = dict(self.module.named_buffers())
        flat += [bufs[n] for n in self._buffer_names]
        flat += [self._local(a, pl) for a, pl in zip(args, self._input_placements)]
        with self._streams.drawing(self._index) if self._streams is not None else contextlib.nullcontext():
            outs = _RunStage.apply(self.program, self._grad_slots, self._states, self._deferred, *flat)
        sends = stage_sends(self._wiring, outs if isinstance(outs, tuple) else (outs,), received)
        sends = tuple(t.contiguous() for t in sends)  # the program's outputs may be views; sends need whole buffers
        return sends if len(sends) > 1 else sends[0]


def draw_list(program: StageProgram) -> list[tuple] | None:
    """The whole-tensor draws of a stage's forward (``random="exact"``) in order, or None when it draws pieces from
    streams of its own (``"local"``: a draw given a ``seed``)."""
    graph = getattr(program, "fw_gm", None)
    if graph is None:
        return []
    out = []
    for n in graph.graph.nodes:
        if n.op == "call_function" and n.target is random_draws.DRAW:
            if n.kwargs.get("seed") is not None:
                return None
            kind, shape, params, dtype, device = n.args[:5]
            out.append((kind, list(shape), list(params), dtype, device, n.kwargs.get("order")))
    return out


__all__ = ["StageModule", "draw_list", "input_key"]
