"""Masters and optimizer state in host memory (ZeRO-Offload), for ``ParamStates``.

An offloaded parameter (``NodeSharding.offload``, chosen by the planner or forced by ``PlanConfig.offload``) is
held as a *master* DTensor in its state layout whose local shard lives on the host (``torch.device("cpu")``,
pinned when the compute device is CUDA). Any ``torch.optim`` optimizer steps it there, so the state it creates
(``zeros_like`` of the master) lives on the host too. Each step:

- the program's gradient, cut to the master's layout on the device, is copied to the host (``to_host``: into a
  pinned buffer kept per parameter, asynchronously, waited for once after the last) and lands in the master's
  ``.grad`` (a host DTensor);
- the optimizer steps the master on the host (the user's ``optimizer.step()``);
- at the next forward the updated shard is copied to the device and gathered to the compute layout
  (``compute_copy``); ``ParamStates`` does this once per change of the master's version, as for ZeRO-1/2.

On a CPU-only run the compute device is the host: the copies are real copies (the compute copy is a distinct
tensor from the master), which is what the CPU tests check; pinning and the device transfers run on a GPU.
The costs priced for this schedule are in ``autoshard/cost/offload.py``.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from autoshard import _torch_compat as tc
from autoshard.errors import CallError

HOST = torch.device("cpu")


class HostOffload:
    """Copies between a mesh's compute device and host memory for offloaded masters."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.device = (
            torch.device(mesh.device_type, torch.cuda.current_device())
            if mesh.device_type == "cuda"
            else torch.device(mesh.device_type)
        )
        self.pin = self.device.type == "cuda"
        # id(master) -> the pinned host buffer its gradient is copied into, reused across steps (pinning
        # fresh memory every step costs more than the copy; a pageable copy runs at a fraction of the link)
        self._grad_buffers: dict[int, torch.Tensor] = {}
        self._pending = False

    def _host_copy(self, local: torch.Tensor) -> torch.Tensor:
        out = local.detach().to(HOST, copy=local.device.type != HOST.type)
        return out.pin_memory() if self.pin and not out.is_pinned() else out

    def ensure_on_host(self, master: torch.Tensor) -> None:
        """Move ``master`` (an ``nn.Parameter`` DTensor) to host memory in place, so that the optimizer, which
        holds the same object, steps it there and makes its state there (nothing to do on a CPU mesh)."""
        local = tc.local_tensor(master)
        if local.device.type == HOST.type and (local.is_pinned() or not self.pin):
            return
        if not isinstance(master, DTensor):
            raise CallError(f"an offloaded master must be a DTensor parameter, got {type(master).__name__}")
        moved = tc.dtensor_like(self._host_copy(local), master)  # (from_local would move it back to the device)
        torch.utils.swap_tensors(master, torch.nn.Parameter(moved, requires_grad=master.requires_grad))

    def compute_copy(self, master: DTensor, compute: tuple[Placement, ...]) -> torch.Tensor:
        """This rank's local piece, on the compute device, of the host master gathered to ``compute``."""
        with torch.no_grad():
            local = tc.local_tensor(master).to(self.device, non_blocking=self.pin, copy=True)
            if tuple(master.placements) == tuple(compute):
                return local
            moved = DTensor.from_local(
                local, self.mesh, master.placements, run_check=False, shape=master.shape, stride=master.stride()
            )
            return moved.redistribute(self.mesh, compute).to_local()

    def to_host(self, grad: DTensor, master: DTensor) -> DTensor:
        """The gradient ``grad`` (laid out like ``master``, on the device) copied to the host, as ``master.grad``
        must be: a DTensor with the master's layout whose local shard is on the host."""
        local = tc.local_tensor(grad).detach()
        if not self.pin:
            return tc.dtensor_like(local.to(HOST), master)
        buf = self._grad_buffers.get(id(master))
        held = master.grad
        if (
            buf is None
            or buf.shape != local.shape
            or buf.dtype != local.dtype
            or (held is not None and tc.local_tensor(held).data_ptr() == buf.data_ptr())
        ):
            # a first step, or the last gradient is still master.grad (accumulating without zero_grad, or
            # zero_grad(set_to_none=False)): a new buffer, so autograd's accumulation never adds a buffer into itself
            buf = torch.empty(local.shape, dtype=local.dtype, pin_memory=True)
            self._grad_buffers[id(master)] = buf
        buf.copy_(local, non_blocking=True)
        self._pending = True
        return tc.dtensor_like(buf, master)

    def wait(self) -> None:
        """Wait for the asynchronous gradient copies to the host (before the optimizer reads them)."""
        if self._pending:
            torch.cuda.current_stream(self.device).synchronize()
            self._pending = False


__all__ = ["HOST", "HostOffload"]
