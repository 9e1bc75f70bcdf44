"""Running a pipelined plan: one sharded program per stage, scheduled by ``torch.distributed.pipelining``.

Each stage is a piece of the model (``torch.distributed.pipelining.pipeline`` cuts it at layer boundaries),
planned on its sub-mesh and compiled like a whole model, except that it returns activations and takes their
gradients (``passes.capture`` with ``ctx.stage``). Here:

- ``StageModule`` runs one stage's compiled program under autograd (``_RunStage``): forward gives the stage's
  outputs, backward takes their gradients and returns the parameters' and the received activations' gradients.
  Its parameters are DTensors with the stage plan's placements, under the model's own names.
- ``LastStage`` makes the last stage fit the pipelining API, whose last stage hands its output to a loss
  function with the micro-batch's target: its module forwards the received activations unchanged and its loss
  function runs the stage program on (activations, target), which ends in the model's own loss.
- ``PipelinedModule`` holds this rank's stages and the schedule (GPipe, 1F1B or interleaved 1F1B, all from
  ``torch.distributed.pipelining``); ``step(*global_inputs)`` trains one step over all micro-batches (gradients
  averaged over them: the full batch's gradient) and returns the loss on every rank. A parameter tied across
  stages (an embedding shared with the LM head) has its gradient summed over its copies after the step.

Stage boundaries carry whole (Replicate) activations: rank r of a stage sends to rank r of the next one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from autoshard import _torch_compat as tc
from autoshard.notation import parse_placements
from autoshard.plan import Plan
from autoshard.runtime.rebind import rebind_optimizers
from autoshard.runtime.sharded_module import distribute_parameters, scatter_grads

log = logging.getLogger(__name__)

EXECUTABLE_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")


class _RunStage(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, program: Any, grad_slots: tuple[int, ...], *flat: torch.Tensor) -> Any:
        outs, saved = program.forward_many([tc.local_tensor(x) for x in flat])
        ctx.program, ctx.saved, ctx.grad_slots = program, saved, grad_slots
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
        grads = ctx.program.backward_many(ctx.saved, grads_in)
        ctx.saved = None
        return (None, None, *scatter_grads(grads, ctx.grad_slots, ctx.like))


class StageModule(nn.Module):
    """One pipeline stage on this rank: global-shaped micro-batch tensors in, the stage's outputs out."""

    def __init__(self, module: nn.Module, mesh: DeviceMesh, plan: Plan, program: Any, grad_names: Sequence[str]) -> None:
        super().__init__()
        self.module = module
        self.plan = plan
        self._program = program
        self._mesh = mesh
        stage = plan.stages[0]
        rebind_optimizers(self, distribute_parameters(module, mesh, plan.parameter_placements()))
        self._param_names = [t.name for t in stage.tensors if t.role == "parameter"]
        self._buffer_names = [t.name for t in stage.tensors if t.role == "buffer"]
        inputs = sorted((t for t in stage.tensors if t.role == "input"), key=lambda t: int(t.name[6:-1]))
        self._input_placements = [parse_placements(t.placements) for t in inputs]
        slot = {n: i for i, n in enumerate(self._param_names)}
        base = len(self._param_names) + len(self._buffer_names)
        slot.update({f"input[{i}]": base + i for i in range(len(inputs))})
        self._grad_slots = tuple(slot[n] for n in grad_names)

    def _local(self, x: torch.Tensor, placements: Sequence[Any]) -> torch.Tensor:
        if all(isinstance(p, Replicate) for p in placements):
            return x  # whole on every rank: no slicing, and autograd reaches the received buffer directly
        rep = [Replicate()] * self._mesh.ndim
        return DTensor.from_local(x, self._mesh, rep, run_check=False).redistribute(self._mesh, placements).to_local()

    def forward(self, *args: torch.Tensor) -> Any:
        if len(args) != len(self._input_placements):
            raise TypeError(f"pipeline stage takes {len(self._input_placements)} tensors, got {len(args)}")
        params = dict(self.module.named_parameters(remove_duplicate=False))
        flat = [params[n] for n in self._param_names]  # DTensors: _RunStage takes their local shards
        bufs = dict(self.module.named_buffers())
        flat += [bufs[n] for n in self._buffer_names]
        flat += [self._local(a, pl) for a, pl in zip(args, self._input_placements)]
        return _RunStage.apply(self._program, self._grad_slots, *flat)


class LastStage(nn.Module):
    """The last stage as ``torch.distributed.pipelining`` wants it: forward passes the received activations on;
    ``loss(output, target)`` runs the stage (which ends in the model's loss) on them and the target."""

    def __init__(self, inner: StageModule) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *acts: torch.Tensor) -> Any:
        return acts if len(acts) > 1 else acts[0]

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        acts = output if isinstance(output, tuple) else (output,)
        return self.inner(*acts, target)


@dataclass(frozen=True)
class TiedParameter:
    """A parameter held by several stages (e.g. the embedding tied to the LM head)."""

    name: str
    stages: tuple[int, ...]
    groups: tuple[Any, ...]  # per local coordinate in the stage sub-mesh: the group of its copies' ranks


def schedule_class(name: str) -> Any:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    table = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B}
    if name not in table:
        raise ValueError(
            f"pipeline schedule {name!r} cannot run here; autoshard runs {EXECUTABLE_SCHEDULES} (zero-bubble "
            "schedules split the backward into input and weight parts, which a compiled stage program does not)"
        )
    return table[name]


class PipelinedModule(nn.Module):
    """This rank's stages of a pipelined plan and their schedule. ``step(*global_inputs)`` trains one step and
    returns the loss (the mean over micro-batches, equal to the full batch's) on every rank; the gradients are
    then in ``.grad`` of :meth:`parameters`, ready for any ``torch.optim`` optimizer."""

    def __init__(
        self,
        plan: Plan,
        stages: dict[int, nn.Module],
        num_stages: int,
        pp_group: Any,
        pp_rank: int,
        stage_inputs: dict[int, tuple[torch.Tensor, ...]],
        stage_outputs: dict[int, tuple[torch.Tensor, ...]],
        input_routes: tuple[tuple[int, ...], tuple[int, ...]],
        tied: Sequence[TiedParameter],
        local_index: int,
        device: torch.device,
        state_names: frozenset[str] | None = None,
    ) -> None:
        super().__init__()
        from torch.distributed.pipelining import PipelineStage

        self.plan = plan
        self.stage_modules = nn.ModuleDict({str(k): m for k, m in sorted(stages.items())})
        self._num_stages = num_stages
        self._pp_group = pp_group
        self._pp_rank = pp_rank
        self._first_inputs, self._target_inputs = input_routes
        self._tied = tuple(tied)
        self._local_index = local_index
        self._state_names = state_names  # the model's own state_dict keys
        pp_size = dist.get_world_size(pp_group)
        self._last_owner = dist.get_global_rank(pp_group, (num_stages - 1) % pp_size)
        self._has_first = 0 in stages
        last = stages.get(num_stages - 1)
        pstages = [
            PipelineStage(m, k, num_stages, device, input_args=stage_inputs[k], output_args=stage_outputs[k],
                          group=pp_group)
            for k, m in sorted(stages.items())
        ]
        cls = schedule_class(plan.schedule or "1F1B")
        loss_fn = last.loss if isinstance(last, LastStage) else _no_loss
        multi = plan.schedule == "Interleaved1F1B"
        self.schedule = cls(pstages if multi else pstages[0], n_microbatches=plan.microbatches, loss_fn=loss_fn,
                            scale_grads=True)

    def forward(self, *args: Any) -> Any:
        raise TypeError(
            "a pipelined module runs forward and backward together, one micro-batch after another: call "
            "sharded.step(*global_inputs) (it returns the loss; the gradients are then in .grad)"
        )

    def step(self, *inputs: torch.Tensor) -> torch.Tensor:
        """One training step on the global batch ``inputs`` (every rank passes the same tensors)."""
        n = len(self._first_inputs) + len(self._target_inputs)
        if len(inputs) != n:
            raise TypeError(f"the pipelined module takes the model's {n} global input tensors, got {len(inputs)}")
        first = [inputs[i] for i in self._first_inputs] if self._has_first else []
        target = inputs[self._target_inputs[0]] if self._target_inputs else None
        losses: list[torch.Tensor] = []
        self.schedule.step(*first, target=target, losses=losses)
        self._sum_tied_grads()
        loss = torch.zeros((), dtype=torch.float32)
        if losses:
            loss = torch.stack([x.detach().float() for x in losses]).mean()
        dist.broadcast(loss, src=self._last_owner, group=self._pp_group)
        return loss

    @torch.no_grad()
    def _sum_tied_grads(self) -> None:
        for t in self._tied:
            copies = [
                p for k, m in self.stage_modules.items() if int(k) in t.stages
                for name, p in m.named_parameters() if _base_name(name) == t.name
            ]
            # to_local() of a DTensor is a view of its local shard: writing it writes the gradient
            locals_ = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in copies if p.grad is not None]
            if not locals_:
                continue
            total = torch.stack(locals_).sum(0)
            group = t.groups[self._local_index]
            if group is not None:
                dist.all_reduce(total, group=group)
            for g in locals_:
                g.copy_(total)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """This rank's stages' state under the model's own names (DTensor values, for distributed checkpoint)."""
        out: dict[str, Any] = {}
        for m in self.stage_modules.values():
            for key, value in m.state_dict(*args, **kwargs).items():
                name = _base_name(key)
                if self._state_names is None or name in self._state_names:  # the cut drops "non-persistent"
                    out[name] = value
        return out

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):  # type: ignore[override]
        """Parameters under the model's names (a tied one appears once per stage copy held here)."""
        for k, m in self.stage_modules.items():
            for name, p in m.named_parameters(prefix="", recurse=recurse, remove_duplicate=remove_duplicate):
                yield prefix + _base_name(name), p


def _base_name(name: str) -> str:
    """``inner.module.layers.0.w`` or ``module.layers.0.w`` (the stage wrappers' prefixes) -> ``layers.0.w``."""
    for head in ("inner.module.", "module."):
        if name.startswith(head):
            return name[len(head):]
    return name


def _no_loss(output: Any, target: Any) -> Any:
    raise RuntimeError("internal: only the last pipeline stage computes the loss")


__all__ = ["EXECUTABLE_SCHEDULES", "LastStage", "PipelinedModule", "StageModule", "TiedParameter", "schedule_class"]
