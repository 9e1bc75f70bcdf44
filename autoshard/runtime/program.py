"""Per-rank executable programs: forward returns (loss, saved), backward(saved, grad_loss) returns gradients.

Two implementations of the same plan:

- ``CompiledProgram``: this rank's lowered joint graph (``passes.lower``) split into forward and backward
  graphs by torch's partitioner, each compiled by Inductor (C++ on CPU, Triton on GPU) or run as FX graphs
  (``backend="eager"``).
- ``InterpretedProgram``: ``PlanInterpreter`` run directly on DTensors, forward nodes then backward nodes.
  Used under ``LocalTensorMode``, where all ranks live in one process and no single rank's graph can be traced.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from autoshard import _torch_compat as tc
from autoshard.passes.context import PassContext
from autoshard.passes.lower import PlanInterpreter, param_placements_of, trace_rank_program
from autoshard.passes.overlap import schedule_overlap

log = logging.getLogger(__name__)

BACKENDS = ("inductor", "eager")


class CompiledProgram:
    def __init__(self, gm: fx.GraphModule, ctx: PassContext, backend: str, overlap: bool = True) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not known; use one of {BACKENDS}")
        decomp = tc.decomposition_table() if backend == "inductor" else None
        with ctx.timed("lower"):
            self.joint = trace_rank_program(gm, ctx, decomp)
        # forward outputs (the loss, or a pipeline stage's activations) come first in the joint graph's outputs
        self.n_out = sum(1 for r in ctx.output_roles if r.kind in ("loss", "output"))
        with ctx.timed("partition"):
            self.fw_gm, self.bw_gm = tc.partition_joint(self.joint, num_fwd_outputs=self.n_out)
        if overlap:
            for part in (self.fw_gm, self.bw_gm):
                for k, v in schedule_overlap(part).items():
                    ctx.stats[f"overlap_{k}"] = ctx.stats.get(f"overlap_{k}", 0) + v
        # which forward outputs have a tangent (those that require grad), in tangent order
        # (a tangent's name is tangent[i] for forward output i; its role's index counts the tangents)
        self.tangent_of = [int(n.meta["autoshard_role"].name[len("tangent["):-1])
                           for n in gm.graph.find_nodes(op="placeholder") if n.meta["autoshard_role"].kind == "tangent"]
        self.backend = backend
        self.n_saved = len(self.fw_gm.graph.find_nodes(op="output")[0].args[0]) - self.n_out
        self._fw = self._bw = None
        self._ctx = ctx

    def _compile(self, gm: fx.GraphModule, args: Sequence[torch.Tensor]) -> Any:
        if self.backend == "eager":
            return lambda xs: gm(*xs)
        with self._ctx.timed("inductor"):
            return tc.inductor_compile(gm, args)

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

    def forward(self, flat: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        outs, saved = self.forward_many(flat)
        return outs[0], saved

    def backward(self, saved: list[torch.Tensor], grad_loss: torch.Tensor) -> list[torch.Tensor]:
        return self.backward_many(saved, [grad_loss.reshape(())])


class InterpretedProgram:
    def __init__(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        self.interp = PlanInterpreter(gm, ctx.mesh)
        self.roles = ctx.output_roles
        self.param_layouts = param_placements_of(gm)
        ph = self.interp.placeholders
        self.primals = [n for n in ph if n.meta["autoshard_role"].kind != "tangent"]
        self.tangents = [n for n in ph if n.meta["autoshard_role"].kind == "tangent"]
        self.fw_nodes = self.interp.phase_nodes("forward")
        self.bw_nodes = self.interp.phase_nodes("backward")

    def forward(self, flat: Sequence[torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
        env: dict[str, Any] = {}
        self.interp.bind(env, self.primals, flat)
        self.interp.run(env, self.fw_nodes)
        loss_node = self.interp.output.args[0][0]
        from torch.distributed.tensor import Replicate

        loss = env[loss_node.name].redistribute(self.interp.mesh, [Replicate()] * self.interp.mesh.ndim).to_local()
        return loss, env

    def backward(self, env: dict[str, Any], grad_loss: torch.Tensor) -> list[torch.Tensor]:
        self.interp.bind(env, self.tangents, [grad_loss.reshape(())])
        self.interp.run(env, self.bw_nodes)
        return self.interp.outputs(env, self.roles, self.param_layouts)[1:]
