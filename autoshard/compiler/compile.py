"""compile: this rank's forward and backward graphs -> the program the runtime runs.

Needs: ``partition`` (and ``overlap``): ``ctx.forward_graph``, ``ctx.backward_graph``, ``ctx.tangent_of``; or,
with ``ctx.backend == "interpret"`` (``LocalTensorMode``: every rank in one process, so no rank's graph can be
traced), only ``solve``.

Guarantees on exit: ``ctx.program`` runs this rank's step, and its ``layouts`` give the placements of the
parameters and inputs by name (``input[i]`` for the call's tensors), as ``Placement`` objects, ``grad_layouts``
those its gradients come back in and ``state_layouts`` those the optimizer steps (they differ for ZeRO-1/2
parameters), ``offload`` the parameters whose masters live in host memory (``runtime/offload.py``): the runtime
distributes parameters and cuts inputs with them (the Plan's strings are for reports and JSON).
``forward(flat local inputs)`` returns (the loss, what backward needs, the new values of the buffers it updates) and
``backward(saved, grad_loss)`` the local gradients (parameters, then inputs that require grad); a pipeline stage's
``forward_many`` / ``backward_many`` take and return every output, and ``backward_input`` / ``backward_weight`` run the
backward in two parts (zero-bubble schedules). Backends:

- ``"inductor"``: each graph compiled by Inductor (C++ on CPU, Triton on GPU), at its first call with the real
  inputs (Inductor specializes on their strides); that compile is timed as ``inductor`` in the step's timings;
- ``"eager"`` (and this pass disabled): the FX graphs run as they are;
- ``"interpret"``: ``PlanInterpreter`` run on DTensors, forward nodes then backward nodes.

The joint graph is returned unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate

from autoshard import _torch_compat as tc
from autoshard.compiler.context import FORWARD_KINDS, PassContext
from autoshard.compiler.lower import PlanInterpreter, param_placements_of
from autoshard.compiler.split_backward import split_backward
from autoshard.errors import InternalError
from autoshard.ir import param_offload_of

log = logging.getLogger(__name__)

Compiler = Callable[[fx.GraphModule, Sequence[torch.Tensor]], Callable[[list[torch.Tensor]], Any]]


def _eager(gm: fx.GraphModule, args: Sequence[torch.Tensor]) -> Callable[[list[torch.Tensor]], Any]:
    return lambda xs: gm(*xs)


class CompiledProgram:
    """A lowered rank's forward and backward graphs, each compiled by ``compiler`` at its first call."""

    def __init__(self, ctx: PassContext, compiler: Compiler) -> None:
        if ctx.forward_graph is None or ctx.backward_graph is None:
            raise InternalError("compile needs partition's forward and backward graphs")
        self.fw_gm, self.bw_gm = ctx.forward_graph, ctx.backward_graph
        self.n_out = ctx.forward_outputs
        self.tangent_of = list(ctx.tangent_of)
        self.n_saved = len(self.fw_gm.graph.find_nodes(op="output")[0].args[0]) - self.n_out
        self._compiler = compiler
        self._fw: Callable[[list[torch.Tensor]], Any] | None = None
        self._bw: Callable[[list[torch.Tensor]], Any] | None = None
        self._ctx = ctx
        forward_roles = [r for r in ctx.output_roles if r.kind in FORWARD_KINDS]
        self.updates = [(i, r.name) for i, r in enumerate(forward_roles) if r.kind == "buffer"]  # (output, buffer)
        planned = ctx.planned
        self.layouts = param_placements_of(planned) if planned is not None else {}
        self.state_layouts = param_placements_of(planned, "state") if planned is not None else {}
        self.grad_layouts = param_placements_of(planned, "grad") if planned is not None else {}
        self.offload = param_offload_of(planned) if planned is not None else {}  # masters in host memory

    def _compile(self, gm: fx.GraphModule, args: Sequence[torch.Tensor]) -> Callable[[list[torch.Tensor]], Any]:
        if self._compiler is _eager:
            return _eager(gm, args)
        with self._ctx.timed("inductor"):
            return self._compiler(gm, args)

    def forward_many(self, flat: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(forward outputs, tensors saved for backward)."""
        if self._fw is None:
            self._fw = self._compile(self.fw_gm, flat)
        outs = list(self._fw(list(flat)))
        return outs[: self.n_out], outs[self.n_out :]

    def backward_many(self, saved: list[torch.Tensor], grad_outs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Gradients (parameters, then inputs that require grad) from the saved tensors and each output's grad
        (``grad_outs`` has one per forward output; those of outputs without a tangent are ignored)."""
        args = list(saved) + [grad_outs[i] for i in self.tangent_of]
        if self._bw is None:
            self._bw = self._compile(self.bw_gm, args)
        return list(self._bw(args))

    def split_backward(self, is_input_grad: Sequence[bool]) -> None:
        """Make :meth:`backward_input` and :meth:`backward_weight` (zero-bubble schedules): ``is_input_grad[k]``
        says whether backward output ``k`` is a received activation's gradient (``compiler/split_backward.py``)."""
        self._split = split_backward(self.bw_gm, is_input_grad)
        self._bw_in = self._bw_w = None

    def backward_input(
        self, saved: list[torch.Tensor], grad_outs: Sequence[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(the input gradients, what :meth:`backward_weight` needs) of :meth:`backward_many`."""
        args = list(saved) + [grad_outs[i] for i in self.tangent_of]
        kept = [args[i] for i in self._split.arg_slots]  # (before the call: a compiled graph may free its args)
        if self._bw_in is None:
            self._bw_in = self._compile(self._split.inputs, args)
        outs = list(self._bw_in(args))
        k = self._split.n_input_grads
        return outs[:k], kept + outs[k:]

    def backward_weight(self, carry: list[torch.Tensor]) -> list[torch.Tensor]:
        """The parameters' gradients, from :meth:`backward_input`'s carry."""
        if self._bw_w is None:
            self._bw_w = self._compile(self._split.weights, carry)
        return list(self._bw_w(carry))

    def forward(self, flat: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
        outs, saved = self.forward_many(flat)
        return outs[0], saved, {name: outs[i] for i, name in self.updates}

    def backward(self, saved: list[torch.Tensor], grad_loss: torch.Tensor) -> list[torch.Tensor]:
        return self.backward_many(saved, [grad_loss.reshape(())])


class InterpretedProgram:
    """The solved global graph run by ``PlanInterpreter`` on DTensors (``LocalTensorMode``)."""

    def __init__(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        self.interp = PlanInterpreter(gm, ctx.mesh)
        self.roles = ctx.output_roles
        self.layouts = param_placements_of(gm)
        self.state_layouts = param_placements_of(gm, "state")
        self.grad_layouts = param_placements_of(gm, "grad")
        self.offload = param_offload_of(gm)
        ph = self.interp.placeholders
        self.primals = [n for n in ph if n.meta["autoshard_role"].kind != "tangent"]
        self.tangents = [n for n in ph if n.meta["autoshard_role"].kind == "tangent"]
        self.fw_nodes = self.interp.phase_nodes("forward")
        self.bw_nodes = self.interp.phase_nodes("backward")

    def forward(self, flat: Sequence[torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any], dict[str, torch.Tensor]]:
        outs, env = self._forward(flat, ("loss", "buffer"))
        loss = next(v for r, v in outs if r.kind == "loss")
        return loss, env, {r.name: v for r, v in outs if r.kind == "buffer"}

    def forward_many(self, flat: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], dict[str, Any]]:
        """Every forward output, whole on every rank (an evaluation program's)."""
        outs, env = self._forward(flat, FORWARD_KINDS)
        return [v for _, v in outs], env

    def _forward(self, flat: Sequence[torch.Tensor], kinds: Sequence[str]) -> tuple[list[tuple[Any, Any]], dict]:
        """Run the forward nodes; (role, local value made Replicate) of the outputs of ``kinds``, and the env."""
        env: dict[str, Any] = {}
        self.interp.bind(env, self.primals, flat)
        self.interp.run(env, self.fw_nodes)
        rep = [Replicate()] * self.interp.mesh.ndim
        outs = [
            (r, env[src.name].redistribute(self.interp.mesh, rep).to_local())
            for src, r in zip(self.interp.output.args[0], self.roles)
            if r.kind in kinds
        ]
        return outs, env

    def backward(self, env: dict[str, Any], grad_loss: torch.Tensor) -> list[torch.Tensor]:
        self.interp.bind(env, self.tangents, [grad_loss.reshape(())])
        self.interp.run(env, self.bw_nodes)
        grads = [r if r.kind in ("grad", "input_grad") else tc.OutputRole("none", r.name) for r in self.roles]
        return self.interp.outputs(env, grads, self.grad_layouts)


def compile_program(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if ctx.backend == "interpret":
        log.info("compile: LocalTensorMode: running the plan with the DTensor interpreter (no per-rank graph)")
        ctx.program = InterpretedProgram(gm, ctx)
    else:
        ctx.program = CompiledProgram(ctx, tc.inductor_compile if ctx.backend == "inductor" else _eager)
    return gm


def run_graphs(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """``compile``'s stand-in when disabled: the forward and backward FX graphs run as they are (the
    interpreter under ``LocalTensorMode``)."""
    if ctx.backend == "interpret":
        return compile_program(gm, ctx)
    ctx.program = CompiledProgram(ctx, _eager)
    return gm
