"""ShardedModule: the user-facing result of ``autoshard.compile``.

It takes over the model's parameters in place (as ``fully_shard`` does; ``runtime/param_takeover.py``): every
parameter becomes an ``nn.Parameter`` holding a DTensor with the solved placements, under the model's own names, so any
``torch.optim`` optimizer works (its state is sharded like the parameters) and ``state_dict()`` is a DTensor
state dict that ``torch.distributed.checkpoint`` saves. Calling it runs this rank's program: forward now,
backward when autograd reaches the loss.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from autoshard import _torch_compat as tc
from autoshard.errors import CallError, InputError
from autoshard.inputs import CallSignature
from autoshard.notation import local_shape
from autoshard.plans.plan import Plan
from autoshard.runtime.accumulate import Accumulation
from autoshard.runtime.evaluate import Evaluator, PlanEval
from autoshard.runtime.input_pieces import Pieces, batch_pieces, check_local, global_pieces, label
from autoshard.runtime.lazy import data_parallel_axes
from autoshard.runtime.model_face import wear_model_face
from autoshard.runtime.param_state import ParamStates, scatter_grads
from autoshard.runtime.param_takeover import as_dtensor, contiguous_strides, take_over
from autoshard.runtime.profile import profile_steps
from autoshard.runtime.program import Program
from autoshard.runtime.rank_failures import one_fails_all
from autoshard.runtime.shapes import PlanShapes, ShapePrograms
from autoshard.weights.deferred import take_deferred
from autoshard.weights.init import init_weights
from autoshard.weights.pretrained import fqn_modifiers, load_pretrained, save_pretrained

log = logging.getLogger(__name__)


class _RunProgram(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        program: Program,
        grad_slots: tuple[int, ...],
        states: ParamStates,
        buffers: Mapping[str, torch.Tensor],
        *flat: torch.Tensor,
    ) -> torch.Tensor:
        loss, saved, updated = program.forward(states.local_inputs(flat))
        for name, value in updated.items():  # BatchNorm's running statistics, computed on the global batch
            buffers[name].copy_(value)
        ctx.program = program
        ctx.saved = saved
        ctx.grad_slots = grad_slots
        ctx.states = states
        ctx.like = [x if isinstance(x, DTensor) else None for x in flat]
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple:
        grads = ctx.program.backward(ctx.saved, grad_loss)
        ctx.saved = None
        return (None, None, None, None, *scatter_grads(grads, ctx.grad_slots, ctx.like, ctx.states))


def _as_is(loss: torch.Tensor) -> torch.Tensor:
    return loss


class ShardedModule(nn.Module):
    """A model sharded by a Plan. ``forward(*local_inputs)`` returns the loss, equal on every rank."""

    def __init__(
        self,
        model: nn.Module,
        mesh: DeviceMesh,
        plan: Plan,
        program: Program,
        grad_names: Sequence[str],
        signature: CallSignature,
        parameters: str = "dtensor",
        accumulation: Accumulation | None = None,
        plan_eval: PlanEval | None = None,
        plan_shapes: PlanShapes | None = None,
    ) -> None:
        super().__init__()
        self.plan = plan
        # the mesh axes a call's rows are split over in evaluation (None: the data-parallel ones; the lazy module
        # sets its own)
        self.batch_axes: tuple[int, ...] | None = None
        self.loss_form: Any = _as_is  # the loss shaped as the model returns it (the lazy module returns that)
        self._accumulation = accumulation  # microbatches > 1: step runs the global batch as micro-batches
        self.signature = signature
        self.mesh = mesh
        self._program = program
        self.module = model
        self._layouts = program.layouts  # Placement objects by name, from the planned graph
        self._param_names = [t.name for t in plan.stages[0].tensors if t.role == "parameter"]
        self._states = ParamStates(mesh, self._param_names, program)
        placements = self._states.master_placements()  # ZeRO-1/2 masters are sharded further than computed with
        self._grad_slots = tuple(self._param_names.index(n) for n in grad_names)
        # buffers stay replicated plain tensors on every rank
        self._buffer_names = [t.name for t in plan.stages[0].tensors if t.role == "buffer"]
        self._inputs = [t for t in plan.stages[0].tensors if t.role == "input"]
        self._inputs.sort(key=lambda t: int(t.name[len("input[") : -1]))
        self._shapes = (
            None
            if plan_shapes is None
            else ShapePrograms(
                mesh,
                plan,
                program,
                self._inputs,
                self._layouts,
                self._param_names,
                signature,
                plan_shapes,
                self._global_view,
                self._label,
            )
        )
        if parameters == "auto":  # plain tensors where every rank holds the whole parameter and state (DDP's)
            whole = all(isinstance(q, Replicate) for pl in placements.values() for q in pl)
            local = whole and not self._states.sharded_masters() and not tc.in_local_tensor_mode()
            parameters = "local" if local else "dtensor"
        self._local_params = parameters == "local"
        if self._local_params and self._states.sharded_masters():
            raise InputError(
                f"parameters='local' holds each parameter in its compute layout; the plan shards the optimizer "
                f"state of {self._states.sharded_masters()[:3]} further (ZeRO-1/2). Plan with "
                "shard_state=False, or use parameters='dtensor'."
            )
        taken = take_over(self, model, mesh, placements, host=self._states.offloaded(), local=self._local_params)
        self._unfilled = taken.unfilled  # what was built on meta and awaits values (init_weights, a checkpoint)
        # an optimizer built on the parameters before they were sharded steps the sharded ones from its next step
        # (runtime/rebind.py); this makes it hold them now (before loading its state from a checkpoint)
        self.adopt_optimizer = taken.adopt_optimizer
        self._evaluator = (
            None
            if plan_eval is None
            else Evaluator(
                model,
                mesh,
                {n: self._layouts[n] for n in self._param_names},
                self._states.master_placements(),
                dict(zip(self._param_names, self._states.offload)),
                plan_eval,
                self._global_view,
            )
        )
        wear_model_face(self, model)
        for call, arg in take_deferred(model):  # init_weights / load_pretrained called on the meta model
            getattr(self, call)(arg)
        if taken.meta:
            log.info(
                "compile: %d parameters built on the meta device hold this rank's shards only; give them values "
                "with init_weights(seed) or a checkpoint before the first step",
                taken.meta,
            )

    def _flat_params(self) -> list[torch.Tensor]:
        params = dict(self.module.named_parameters(remove_duplicate=False))
        return [params[name] for name in self._param_names]  # DTensors: _RunProgram takes their local shards

    def expected_local_shapes(self) -> list[tuple[int, ...]]:
        return [local_shape(t.shape, t.placements, self.plan.mesh.shape) for t in self._inputs]

    def shard_inputs(self, *args: Any, **kwargs: Any) -> Any:
        """This rank's pieces of a global-shaped call, as the plan's input placements say, shaped like the call:
        a tuple for positional tensors (``sharded(*pieces)``), a dict for keyword arguments
        (``sharded(**pieces)``), or ``(args, kwargs)`` for both. In ``eval()`` mode: any call, each tensor split
        on dim 0 over the data-parallel axes (what ``evaluate`` takes)."""
        return self.pieces(*args, **kwargs).shaped()

    def pieces(self, *args: Any, **kwargs: Any) -> Pieces:
        """``shard_inputs`` as one value (``runtime/input_pieces.py``)."""
        if not self.training:
            dp = data_parallel_axes(self.mesh) if self.batch_axes is None else self.batch_axes
            return batch_pieces(self.mesh, dp, args, kwargs)
        tensors = self.signature.flatten(args, kwargs)
        return global_pieces(
            tensors, self._inputs, self._layouts, self.mesh, self.signature, self.plan.mesh, self._shapes is not None
        )

    def _label(self, name: str) -> str:
        return label(self.signature, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """This rank's pieces of the call (``shard_inputs``), called as the model is; returns the loss. In
        ``eval()`` mode: the model's whole output, from a forward-only program (``runtime/evaluate.py``). An
        exception on one rank ends every rank (``runtime/rank_failures.py``)."""
        with one_fails_all("the forward", self.mesh):
            return self._forward(*args, **kwargs)

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.training:
            return self.evaluate(*args, **kwargs)
        tensors = self.signature.flatten(args, kwargs)
        self._switch_shapes(tensors)
        check_local(tensors, self._inputs, self.expected_local_shapes(), self.signature, self.plan.mesh)
        if self._unfilled.missing():  # built on meta: derived buffers (no checkpoint holds them) are computed now
            self._recompute_unsaved()
            self._unfilled.check()
        buffers = dict(self.module.named_buffers())  # read by the program; those it updates are written back
        flat = self._flat_params() + [buffers[n] for n in self._buffer_names] + list(tensors)
        return _RunProgram.apply(self._program, self._grad_slots, self._states, buffers, *flat)

    def _switch_shapes(self, tensors: Sequence[Any]) -> None:
        """Run the program planned for these local input shapes (``runtime/shapes.py``)."""
        if self._shapes is not None and len(tensors) == len(self._inputs) and not tc.in_local_tensor_mode():
            found = self._shapes.program_for(tensors, self.expected_local_shapes())
            if found is not None:
                self._program, self._inputs = found

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """The model's output (a ``ModelOutput``, tuple or tensor, every tensor whole on every rank) for this
        rank's pieces of a call (dim 0 split over the data-parallel axes: ``shard_inputs`` in eval mode), from a
        forward-only program planned on the parameters' shards; the model runs in its current mode (call
        ``eval()`` first for dropout off and BatchNorm's running statistics)."""
        if self._evaluator is None:
            raise CallError("this module was built without an evaluation planner (autoshard.compile builds one)")
        if self._unfilled.missing():
            self._recompute_unsaved()
            self._unfilled.check()
        return self._evaluator(args, kwargs, self.batch_axes)

    def step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """One training step's forward and backward on a global-shaped call (as ``PipelinedModule.step``):
        returns the loss; the gradients are then in ``.grad``.

        Planned with ``microbatches=k`` (gradient accumulation, ``runtime/accumulate.py``): the call is cut into
        ``k`` micro-batches along dim 0, each runs forward and backward (gradients add up in ``.grad``) with its
        loss weighted so that the returned loss and the gradients are the whole batch's. Calling the module
        itself (``sharded(*pieces)``) still runs one micro-batch (``shard_inputs`` of a micro-batch's call).
        An exception on one rank ends every rank, naming it (``runtime/rank_failures.py``)."""
        with one_fails_all("a training step", self.mesh):
            acc = self._accumulation
            if acc is None:
                loss = self.pieces(*args, **kwargs).call(self)
                loss.backward()
                return loss.detach()
            micro = acc.split(self.signature.names, self.signature.flatten(args, kwargs))
            total: torch.Tensor | None = None
            for tensors, weight in zip(micro, acc.weights(micro)):
                if weight == 0.0:
                    continue  # counts no target (all padding): adds nothing to the loss or the gradients
                m_args, m_kwargs = self.signature.unflatten(tensors)
                loss = self.pieces(*m_args, **m_kwargs).call(self)
                (loss * weight).backward()
                part = loss.detach() * weight
                total = part if total is None else total + part
            assert total is not None  # weights sum to 1 (or k for a sum): at least one is not 0
            return total

    def profile(
        self,
        *args: Any,
        steps: int = 3,
        warmup: int = 1,
        optimizer: torch.optim.Optimizer | None = None,
        path: str | Path = "autoshard_trace.json.gz",
        **kwargs: Any,
    ) -> Path:
        """Train ``warmup`` + ``steps`` steps on the global-shaped call (``step``'s, then ``optimizer``'s step when
        given), the last ``steps`` under torch.profiler, and write its trace with the plan's predicted step beside
        it, for Perfetto or ``chrome://tracing`` (``runtime/profile.py``); returns this rank's file."""
        return profile_steps(self, args, kwargs, steps=steps, warmup=warmup, optimizer=optimizer, path=path)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The model's state dict; parameters as DTensors with the plan's placements (for DCP), also when they
        are held as plain local shards (``parameters="local"``)."""
        state = self.module.state_dict(*args, **kwargs)
        if not kwargs.get("keep_vars", False):
            # state_dict() detaches each DTensor into a new local tensor object with its own version counter; one
            # wrapping the parameter's own local tensor lets a load into it (dcp.load) be seen as a write
            # (ZeRO's compute copies and the meta-built check follow version counters)
            prefix = kwargs.get("prefix", "")
            for name, p in self.module.named_parameters(remove_duplicate=False):
                if isinstance(p, DTensor) and isinstance(state.get(prefix + name), DTensor):
                    state[prefix + name] = tc.dtensor_like(tc.local_tensor(p), p)
        if self._local_params:
            layouts = {t.name: t for t in self.plan.stages[0].tensors if t.role == "parameter"}
            prefix = kwargs.get("prefix", "")
            for name, t in layouts.items():
                key = prefix + name
                if key in state and not isinstance(state[key], DTensor):
                    state[key] = DTensor.from_local(
                        state[key],
                        self.mesh,
                        self._layouts[name],
                        run_check=False,
                        shape=torch.Size(t.shape),
                        stride=contiguous_strides(t.shape),
                    )
        return state

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        """Load a state dict (``state_dict()``'s DTensors, or whole tensors for DTensor parameters); parameters held
        as local shards take their shard of each DTensor value."""
        if self._local_params:
            state_dict = {
                k: (
                    v.redistribute(self.mesh, self._layouts[k]).to_local()
                    if isinstance(v, DTensor) and k in self._layouts
                    else v
                )
                for k, v in state_dict.items()
            }
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):  # type: ignore[override]
        return self.module.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def _fqn_modifiers(self) -> dict[str, str]:
        """For ``torch.distributed.checkpoint.state_dict`` (``get_state_dict`` / ``set_state_dict``): this wrapper
        adds no name, so its keys are the model's (``model.layers.0...``, not ``module.model.layers.0...``)."""
        return fqn_modifiers(self.module, "module")

    def init_weights(self, seed: int = 0) -> None:
        """Initialize every parameter and buffer as the model's own code does (``reset_parameters``, Hugging
        Face's ``_init_weights``, a model's ``init_weights()``), one whole tensor at a time cut to this rank's
        shards; the same ``seed`` gives the same model on any mesh and plan (``autoshard/weights/init.py``)."""
        written = init_weights(self._global_view(), seed)
        if self._local_params:  # written through DTensors over the shards, whose version counters are their own
            self._unfilled.mark_filled(written)
        self._unfilled.check_after("init_weights", type(self.module).__name__)

    def _global_view(self) -> nn.Module:
        """The model as init code and planning must see it: every parameter at its global shape. Parameters held
        as local shards (``parameters="local"``) look local to code that reads ``p.shape``; this is then a
        structural copy of the model whose parameters are DTensors over those very shards (writes land in them)."""
        if not self._local_params:
            return self.module
        memo: dict[int, Any] = {id(b): b for b in self.module.buffers()}
        for p in self.module.parameters():
            memo[id(p)] = nn.Parameter(as_dtensor(p), requires_grad=p.requires_grad)
        return copy.deepcopy(self.module, memo)

    def load_pretrained(self, path: str, *, strict: bool = True) -> None:
        """Load a ``save_pretrained`` directory (safetensors) into the shards, each rank reading only its slices
        (``autoshard/weights/pretrained.py``)."""
        load_pretrained(self, path, strict=strict)
        self._recompute_unsaved()
        self._unfilled.check_after("load_pretrained", path)

    def _recompute_unsaved(self) -> None:
        """Buffers no checkpoint holds (non-persistent: rotary tables, masks) recomputed by their modules' init."""
        unsaved = set(self._unfilled.missing()) - set(self.module.state_dict(keep_vars=True))
        if unsaved:
            init_weights(self.module, 0, only=unsaved)

    def save_pretrained(self, path: str, **kwargs: Any) -> None:
        """Write the model as ``from_pretrained`` reads it (config and safetensors), each rank writing its shards
        (``autoshard/weights/pretrained.py``)."""
        save_pretrained(self, self.module, path, **kwargs)
