"""Running a pipelined plan: one sharded program per stage, scheduled by ``torch.distributed.pipelining``.

Each stage is a piece of the model (``torch.distributed.pipelining.pipeline`` cuts it at layer boundaries),
planned on its sub-mesh and compiled like a whole model, except that it returns activations and takes their
gradients (``passes.capture`` with ``ctx.stage``). Here:

- ``StageModule`` (``runtime/stage_module.py``) runs one stage's compiled program under autograd (``_RunStage``):
  forward gives the stage's outputs, backward takes their gradients and returns the parameters' and the received
  activations' gradients. Its parameters are DTensors with the stage plan's placements, under the model's own names.
- The last stage returns the model's loss; the schedule's loss function weights it per micro-batch so that the
  mean over micro-batches is the whole batch's loss (``runtime/stage_values.py: loss_weights``).
- ``PipelinedModule`` holds this rank's stages and the schedule (GPipe, 1F1B, interleaved 1F1B or interleaved
  zero-bubble, all from ``torch.distributed.pipelining``; the zero-bubble one runs each stage's backward in two
  parts, ``runtime/deferred_weights.py``); ``step(...)`` trains one step over all micro-batches (the whole batch's loss
  and gradients) and returns the loss on every rank. A parameter tied across
  stages (an embedding shared with the LM head) has its gradient summed over its copies after the step.

Stage boundaries carry whole (Replicate) activations: rank r of a stage sends to rank r of the next one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autoshard.errors import CallError, InputError, InternalError
from autoshard.inputs import CallSignature
from autoshard.plans.plan import Plan
from autoshard.rules import random_draws
from autoshard.runtime.profile import profile_steps
from autoshard.runtime.rank_failures import one_fails_all
from autoshard.runtime.stage_module import StageModule, draw_list, input_key
from autoshard.runtime.stage_random import ReplayStreams, StageStreams
from autoshard.runtime.stage_values import loss_weights
from autoshard.weights.deferred import take_deferred
from autoshard.weights.init import init_weights
from autoshard.weights.pretrained import load_pretrained, save_pretrained

log = logging.getLogger(__name__)

EXECUTABLE_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble")


@dataclass(frozen=True)
class TiedParameter:
    """A parameter held by several stages (e.g. the embedding tied to the LM head)."""

    name: str
    stages: tuple[int, ...]
    groups: tuple[Any, ...]  # per local coordinate in the stage sub-mesh: the group of its copies' ranks


def schedule_class(name: str) -> Any:
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )

    table = {
        "GPipe": ScheduleGPipe,
        "1F1B": Schedule1F1B,
        "Interleaved1F1B": ScheduleInterleaved1F1B,
        "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
    }
    if name not in table:
        raise InputError(f"pipeline schedule {name!r} cannot run here; autoshard runs {EXECUTABLE_SCHEDULES}")
    return table[name]


@dataclass(frozen=True)
class LossWeighting:
    """How the last stage's per-micro-batch losses make the whole batch's
    (``runtime/stage_values.py: loss_weights``)."""

    reduction: int
    counter: Callable[..., torch.Tensor] | None


class PipelinedModule(nn.Module):
    """This rank's stages of a pipelined plan and their schedule. ``step(*args, **kwargs)`` takes the global
    batch, called as the model is (every rank passes the same tensors), trains one step over all micro-batches
    and returns the whole batch's loss on every rank; the gradients are then in ``.grad`` of
    :meth:`parameters`, ready for any ``torch.optim`` optimizer. The same loop serves a ``ShardedModule``.
    ``split_backward``: the schedule runs each stage's backward in input and weight parts (zero-bubble)."""

    def __init__(
        self,
        plan: Plan,
        stages: dict[int, StageModule],
        num_stages: int,
        pp_group: Any,
        pp_rank: int,
        stage_inputs: dict[int, tuple[torch.Tensor, ...]],
        stage_outputs: dict[int, tuple[torch.Tensor, ...]],
        signature: CallSignature,
        weighting: LossWeighting,
        tied: Sequence[TiedParameter],
        local_index: int,
        device: torch.device,
        canonical: dict[str, str],
        state_names: frozenset[str] | None = None,
        tree: nn.Module | None = None,
        split_backward: bool = False,
    ) -> None:
        super().__init__()
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import PipelineScheduleMulti

        self.plan = plan
        self.signature = signature
        self.stage_modules = _Stages({str(k): m for k, m in sorted(stages.items())})
        self._num_stages = num_stages
        self._pp_group = pp_group
        self._weighting = weighting
        self._tied = tuple(tied)
        self._local_index = local_index
        self._canonical = canonical  # every name of a parameter (tied ones have several) -> the model's first
        self._state_names = state_names  # the model's own state_dict keys
        self._aliases: dict[str, tuple[str, ...]] = {}  # first name -> every name (tied parameters have several)
        for alias, first in canonical.items():
            self._aliases[first] = (*self._aliases.get(first, ()), alias)
        self._device = device
        object.__setattr__(self, "_tree", tree)  # the model as built (its init code), not a submodule
        for call, arg in take_deferred(tree) if tree is not None else ():  # autoshard.init_weights(model) before
            getattr(self, call)(arg)
        self._used_inputs = sorted({i for m in stages.values() for kind, i in m._wiring.args if kind == "input"})
        self._streams = _streams(device, stages, pp_group, plan.microbatches)
        for k, m in stages.items():
            m._streams, m._index = self._streams, k  # (a stage's own plan numbers its one stage 0)
        pp_size = dist.get_world_size(pp_group)
        self._last_owner = dist.get_global_rank(pp_group, (num_stages - 1) % pp_size)
        self._has_last = num_stages - 1 in stages
        pstages = [
            PipelineStage(
                m,
                k,
                num_stages,
                device,
                input_args=stage_inputs[k],
                output_args=stage_outputs[k],
                group=pp_group,
                dw_builder=m.defer_weights() if split_backward else None,
            )
            for k, m in sorted(stages.items())
        ]
        cls = schedule_class(plan.schedule or "1F1B")
        multi = issubclass(cls, PipelineScheduleMulti)  # several stages per rank: they take the list
        self.schedule = cls(
            pstages if multi else pstages[0], n_microbatches=plan.microbatches, loss_fn=_weighted, scale_grads=True
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise CallError(
            "a pipelined module runs forward and backward together, one micro-batch after another: call "
            "sharded.step(...) with the global batch, as you call the model (it returns the loss; the gradients "
            "are then in .grad)"
        )

    def shard_inputs(self, *args: Any, **kwargs: Any) -> Any:
        raise CallError(
            "a pipelined module takes the global batch on every rank (the schedule cuts it into micro-batches and "
            "each stage takes its part): call sharded.step(...) with the global batch, not its shards"
        )

    def _targets(self) -> dict[str, list[torch.Tensor]]:
        """Every name of the model's tensors -> this rank's stage tensors holding it (tied copies included)."""
        held: dict[str, list[torch.Tensor]] = {}
        for m in self.stage_modules.values():
            for n, t in [*m.module.named_parameters(remove_duplicate=False), *m.module.named_buffers()]:
                held.setdefault(self._canonical.get(n, n), []).append(t)
        names = [n for n, _ in self._tree.named_parameters(remove_duplicate=False)]
        names += [n for n, _ in self._tree.named_buffers(remove_duplicate=False)]
        return {n: held[self._canonical.get(n, n)] for n in names if self._canonical.get(n, n) in held}

    def init_weights(self, seed: int = 0) -> None:
        """The model's own initialization on this rank's stages (``ShardedModule.init_weights``): run on the
        model as built, each whole tensor cut into the stage shards that hold it."""
        init_weights(self._tree, seed, targets=self._targets(), device=self._device)
        for m in self.stage_modules.values():
            m._unfilled.check_after("init_weights", type(self._tree).__name__)

    def load_pretrained(self, path: str, *, strict: bool = True) -> None:
        """A ``save_pretrained`` directory into this rank's stages (each rank reads only its slices)."""
        load_pretrained(self, path, strict=strict, model=self._tree, expected=self._state_names, tied=self._canonical)
        self._recompute_unsaved()
        for m in self.stage_modules.values():
            m._unfilled.check_after("load_pretrained", path)

    def save_pretrained(self, path: str, **kwargs: Any) -> None:  # as from_pretrained reads it, each rank its shards
        save_pretrained(self, self._tree, path, **kwargs)

    def _recompute_unsaved(self) -> None:
        unsaved = {n for m in self.stage_modules.values() for n in m._unfilled.missing()} - set(self._state_names or ())
        if unsaved:
            targets = self._targets()
            init_weights(
                self._tree,
                0,
                targets={n: targets[n] for n in unsaved if n in targets},
                device=self._device,
                only=unsaved,
            )

    def step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """One training step on the global batch, called as the model is (every rank passes the same tensors). An
        exception on one rank ends every rank, naming it (``runtime/rank_failures.py``)."""
        with one_fails_all("a pipelined training step", self._any_mesh()):
            return self._step(*args, **kwargs)

    def _any_mesh(self) -> DeviceMesh | None:
        """A mesh of this rank's stages (they share their root mesh's groups)."""
        return next((m._mesh for m in self.stage_modules.values()), None)

    def _step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if any(m._unfilled.missing() for m in self.stage_modules.values()):
            self._recompute_unsaved()
            for m in self.stage_modules.values():
                m._unfilled.check()
        tensors = self.signature.flatten(args, kwargs)
        m = self.plan.microbatches
        for i in self._used_inputs:
            t = tensors[i]
            if t.ndim == 0 or t.shape[0] % m:
                raise InputError(
                    f"argument {self.signature.names[i]} of shape {tuple(t.shape)}: the pipeline cuts every input "
                    f"into {m} micro-batches along dim 0, which must divide by {m}"
                )
        target = None
        if self._has_last:  # the schedule hands each micro-batch's weight to the loss function as its "target"
            target = loss_weights(self._weighting.reduction, self._weighting.counter, tensors, m)
        losses: list[torch.Tensor] = []
        if self._streams is not None:
            self._streams.begin_step()
        self.schedule.step(target=target, losses=losses, **{input_key(i): tensors[i] for i in self._used_inputs})
        self._sum_tied_grads()
        loss = torch.zeros((), dtype=torch.float32)
        if losses:
            loss = torch.stack([x.detach().float() for x in losses]).mean()
        dist.broadcast(loss, src=self._last_owner, group=self._pp_group)
        return loss

    def _copies(self, name: str) -> list[torch.Tensor]:
        """This rank's copies of the model parameter ``name`` (one per local stage holding it, under any alias)."""
        out: dict[int, torch.Tensor] = {}
        for m in self.stage_modules.values():
            for alias, p in m.named_parameters(remove_duplicate=False):
                if self._canonical.get(_base_name(alias), _base_name(alias)) == name:
                    out.setdefault(id(p), p)
        return list(out.values())

    @torch.no_grad()
    def _sum_tied_grads(self) -> None:
        local = {int(k) for k in self.stage_modules}
        for t in self._tied:
            if not local & set(t.stages):
                continue  # no copy here (the group's ranks are those of the stages holding one)
            copies = self._copies(t.name)
            # to_local() of a DTensor is a view of its local shard: writing it writes the gradient
            locals_ = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in copies]
            if not locals_ or any(g is None for g in locals_):
                raise InternalError(f"tied parameter {t.name} has no gradient in a stage that holds it here")
            total = torch.stack(locals_).sum(0)
            group = t.groups[self._local_index]
            if group is not None:
                dist.all_reduce(total, group=group)
            for g in locals_:
                g.copy_(total)

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
        """This rank's stages' state under the model's own names (DTensor values, for distributed checkpoint); a
        parameter tied across stages (an LM head sharing the embedding) under its first name, once per copy."""
        out: dict[str, Any] = {}
        for m in self.stage_modules.values():
            for key, value in m.state_dict(*args, **kwargs).items():
                first = self._canonical.get(_base_name(key), _base_name(key))
                for name in self._aliases.get(first, (first,)):  # a tied copy: under each of the model's names
                    if self._state_names is None or name in self._state_names:  # the cut drops "non-persistent"
                        out[name] = value
        return out

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        """Load this rank's stages' entries of ``state_dict`` (the model's names, as :meth:`state_dict` gives)."""
        used: set[str] = set()
        missing: list[str] = []
        for m in self.stage_modules.values():
            # the cut adds constants the model's state dict does not have: only the model's own keys count
            own = {k: self._canonical.get(k, k) for k in m.module.state_dict()}
            own = {k: c for k, c in own.items() if self._state_names is None or c in self._state_names}
            part = {k: state_dict[c] for k, c in own.items() if c in state_dict}
            used |= {own[k] for k in part}
            missing += sorted(c for k, c in own.items() if k not in part)
            m.module.load_state_dict(part, strict=False, assign=assign)
        unknown = sorted(set(state_dict) - used - set(self._state_names or ()))
        if strict and (unknown or missing):
            raise KeyError(
                f"load_state_dict: missing {missing[:5]}, unexpected {unknown[:5]} (this rank's stages "
                "hold the model's names that state_dict() gives)"
            )

    def _fqn_modifiers(self) -> dict[str, str]:
        """For ``torch.distributed.checkpoint.state_dict`` (``get_state_dict`` / ``set_state_dict``): the stage
        wrappers add no names (with ``_Stages`` and ``StageModule``'s), so its names are the model's."""
        return {"stage_modules": "stage_modules"}

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in {k.split(".")[0] for k in [*self._canonical, *(self._state_names or ())]}:
                return _Path()  # torch's state-dict API walks a key's path; the stages hold the tensors
            raise

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):  # type: ignore[override]
        """Parameters under the model's names (a tied one under its first name, once per stage copy held here)."""
        for m in self.stage_modules.values():
            for name, p in m.named_parameters(prefix="", recurse=recurse, remove_duplicate=remove_duplicate):
                base = _base_name(name)
                yield prefix + self._canonical.get(base, base), p


def _streams(
    device: torch.device, stages: dict[int, StageModule], pp_group: Any, microbatches: int
) -> StageStreams | ReplayStreams | None:
    """Exact draws (every stage's program draws whole tensors): one device's states replayed; pieces: stage
    streams; no draws at all: None (the generator left as one device leaves it)."""
    mine = {k: draw_list(m.program) for k, m in stages.items()}
    every: list[Any] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(every, mine, group=pp_group)
    lists = {k: v for part in every for k, v in part.items()}
    if all(v == [] for v in lists.values()):
        return None
    if any(v is None for v in lists.values()):
        return StageStreams(device, sorted(stages))
    return ReplayStreams(device, sorted(stages), lists, microbatches, random_draws.DRAW)


class _Stages(nn.ModuleDict):  # this rank's stages by index; adds no name in torch's state-dict API
    def _fqn_modifiers(self) -> dict[str, str]:
        return {k: k for k in self.keys()}


class _Path:
    """Any attribute path below a pipelined model's top-level name (torch's state-dict API only checks that a key's
    path resolves; this rank's stages, not one module tree, hold the tensors)."""

    def __getattr__(self, name: str) -> _Path:
        if name == "_fqn_modifiers" or name.startswith("__"):
            raise AttributeError(name)
        return self


def _weighted(output: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The last stage's loss for one micro-batch times its weight (see ``runtime/stage_values.py: loss_weights``)."""
    return (output * weight).reshape(())


def _base_name(name: str) -> str:
    """``module.layers.0.w`` (the stage wrapper's prefix) -> ``layers.0.w``."""
    return name[len("module.") :] if name.startswith("module.") else name


__all__ = [
    "EXECUTABLE_SCHEDULES",
    "LossWeighting",
    "PipelinedModule",
    "TiedParameter",
    "schedule_class",
]
