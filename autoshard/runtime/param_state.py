"""Where a parameter lives between steps, and the layout it is computed with.

Under most plans a parameter has one layout: the optimizer steps the DTensor the program computes with (DDP,
FSDP, TP). Under ZeRO-1/2 (``NodeSharding.state``) the optimizer steps a *master* sharded further than the
compute layout (its state is sharded like it), and the program computes with a copy in the compute layout:

- the copy is gathered from the master at the first forward after the master changed, so it is gathered once per
  step, not once per forward, and never used stale. A change is an in-place write that bumps the parameter's
  version counter (``load_state_dict``, ``dcp.load``, a ``foreach`` optimizer) or a step of any ``torch.optim``
  optimizer holding the parameter with a gradient: fused optimizers (``AdamW(fused=True)``) write through kernels
  that bump no counter, so a global optimizer post-step hook counts the steps each parameter took;
- the program delivers the gradient in its gradient layout (ZeRO-2: reduce-scattered to the master's layout;
  ZeRO-1: all-reduced whole), which is then cut to the master's layout on each rank (no communication).

``ParamStates`` does both for ``ShardedModule`` and the pipeline stages; parameters are passed to the autograd
functions as the masters, so ``.grad`` lands on what the optimizer steps.

An offloaded parameter (``program.offload``: name -> "optimizer" / "params", from ``NodeSharding.offload``) has
its master, and so its optimizer state, in host memory (``autoshard/runtime/offload.py``): the compute copy is the
master uploaded and gathered at the first forward after each step, and the gradient is copied to the host.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement
from torch.optim.optimizer import register_optimizer_step_post_hook

from autoshard import _torch_compat as tc
from autoshard.buckets import gather_all, gather_axes
from autoshard.errors import CallError
from autoshard.runtime.offload import HostOffload
from autoshard.runtime.program import Program

Layout = tuple[Placement, ...]

_STEPS: dict[int, int] = {}  # id(parameter) -> optimizer steps it took with a gradient (see _count_steps)
_HOOKED: list[Any] = []  # the global post-step hook's handle, once registered


def _count_steps(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                _STEPS[id(p)] = _STEPS.get(id(p), 0) + 1


def _watch_optimizer_steps() -> None:
    if not _HOOKED:
        _HOOKED.append(register_optimizer_step_post_hook(_count_steps))


class ParamStates:
    """The compute, gradient and master layouts of a program's parameters (by ``names``, in the program's
    order), and the gathered compute copies of those whose master is sharded further."""

    def __init__(
        self, mesh: DeviceMesh, names: Sequence[str], program: Program, offload: Mapping[str, str] | None = None
    ) -> None:
        self.mesh = mesh
        self.names = list(names)
        compute: Mapping[str, Layout] = program.layouts
        grad: Mapping[str, Layout] = getattr(program, "grad_layouts", compute)
        state: Mapping[str, Layout] = getattr(program, "state_layouts", compute)
        self.compute = [tuple(compute[n]) for n in self.names]
        self.grad = [tuple(grad.get(n, compute[n])) for n in self.names]
        self.state = [tuple(state.get(n, compute[n])) for n in self.names]
        modes: Mapping[str, str] = offload if offload is not None else getattr(program, "offload", {})
        self.offload = [modes.get(n, "") for n in self.names]  # "" on the device, else "optimizer" / "params"
        self._host = HostOffload(mesh) if any(self.offload) else None
        self._copies: dict[int, tuple[int, tuple[int, int, int], torch.Tensor]] = {}  # slot -> (id, version, copy)
        if any(c != st for c, st in zip(self.compute, self.state)) or self._host is not None:
            _watch_optimizer_steps()

    def master_placements(self) -> dict[str, Layout]:
        """The layout each parameter is held (and stepped by the optimizer) in."""
        return dict(zip(self.names, self.state))

    def sharded_masters(self) -> list[str]:
        """Parameters whose master is not the tensor the program computes with (ZeRO-1/2, offloaded)."""
        return [n for n, c, s, o in zip(self.names, self.compute, self.state, self.offload) if c != s or o]

    def offloaded(self) -> list[str]:
        """Parameters whose master and optimizer state live in host memory."""
        return [n for n, o in zip(self.names, self.offload) if o]

    def local_inputs(self, flat: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The program's local inputs: compute copies for the first ``len(names)`` (the parameters), the local
        shard of everything else. Stale copies that are only even all-gathers of one dim from their master
        (ZeRO's, after each step) are gathered together: one all-gather per mesh axes and dtype, not one per
        parameter."""
        out: list[torch.Tensor | None] = []
        stale: dict[tuple, list[int]] = {}
        for i, x in enumerate(flat):
            if i >= len(self.names) or (self.compute[i] == self.state[i] and not self.offload[i]):
                out.append(tc.local_tensor(x))
                continue
            hit = self._copies.get(i)
            axes = gather_axes(self.state[i], self.compute[i], tuple(x.shape), tuple(self.mesh.shape))
            if (hit is None or hit[:2] != (id(x), _version(x))) and axes and not self.offload[i]:
                stale.setdefault((axes, x.dtype), []).append(i)
                out.append(None)
                continue
            out.append(self._copy(i, x))
        for (axes, _), slots in stale.items():
            masters = [flat[i] for i in slots]
            if not all(isinstance(m, DTensor) for m in masters):
                raise CallError(f"parameters {[self.names[i] for i in slots]}: their masters must be DTensors")
            with torch.no_grad():
                copies = gather_all(self.mesh, axes, [m.detach() for m in masters])  # -> their compute layouts
            for i, m, c in zip(slots, masters, copies):
                self._copies[i] = (id(m), _version(m), tc.waited(c.to_local()))
                out[i] = self._copies[i][2]
        return out  # type: ignore[return-value]

    def _copy(self, i: int, master: torch.Tensor) -> torch.Tensor:
        # the DTensor's own version counter: in-place ops reach its local shard below autograd's view/version layer,
        # so only the outer tensor's counter moves
        key = (id(master), _version(master))
        hit = self._copies.get(i)
        if hit is None or hit[:2] != key:
            if not isinstance(master, DTensor):
                raise CallError(
                    f"parameter {self.names[i]}: its master must be a DTensor (got {type(master).__name__})"
                )
            if self._host is not None and self.offload[i]:
                self._host.ensure_on_host(master)  # (in place: the optimizer holds this object)
                key = (id(master), _version(master))
                copy = self._host.compute_copy(master, self.compute[i])
            else:
                with torch.no_grad():
                    copy = master.detach().redistribute(self.mesh, self.compute[i]).to_local()
            self._copies[i] = (*key, copy)
        return self._copies[i][2]

    def gradient(self, slot: int, grad: torch.Tensor, like: DTensor) -> DTensor:
        """The program's local gradient of parameter ``slot`` as a DTensor laid out like its master ``like``."""
        if self.grad[slot] == self.state[slot]:
            out = tc.dtensor_like(grad, like)
        else:
            whole = DTensor.from_local(
                grad, self.mesh, self.grad[slot], run_check=False, shape=like.shape, stride=like.stride()
            )
            out = whole.redistribute(self.mesh, self.state[slot])  # a local cut: the master is sharded further
        if self._host is not None and self.offload[slot]:
            return self._host.to_host(out, like)  # the master (and so its .grad) lives in host memory
        return out


def _version(master: torch.Tensor) -> tuple[int, int, int]:
    """Changes with any write to the master: through DTensor ops (its own counter), into its local tensor (a
    checkpoint loaded in place, ``dcp.load``: only the local tensor's counter moves) or by an optimizer step
    (a fused kernel moves neither counter)."""
    return master._version, tc.local_tensor(master)._version, _STEPS.get(id(master), 0)


def scatter_grads(
    grads: Sequence[torch.Tensor],
    slots: Sequence[int],
    like: Sequence[DTensor | None],
    states: ParamStates | None = None,
) -> list[torch.Tensor | None]:
    """The program's (local) gradients placed at their inputs' positions among the flat inputs (None
    elsewhere); the gradient of a DTensor input (a parameter, passed whole so that autograd records no
    ``to_local`` per parameter and step) is wrapped in that parameter's (master's) layout."""
    full: list[torch.Tensor | None] = [None] * len(like)
    for slot, g in zip(slots, grads):
        ref = like[slot]
        if ref is None:
            full[slot] = g
        elif states is not None and slot < len(states.names):
            full[slot] = states.gradient(slot, g, ref)
        else:
            full[slot] = tc.dtensor_like(g, ref)
    if states is not None and states._host is not None:
        states._host.wait()  # the gradients' copies to pinned host memory ran asynchronously
    return full


__all__ = ["ParamStates", "scatter_grads"]
