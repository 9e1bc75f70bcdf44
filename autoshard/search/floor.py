"""The least memory any plan of a model needs per device, known before anything is captured or solved: its training
state sharded over every device of the mesh.

Whatever the plan (data, tensor, sequence or expert parallel, pipeline stages, recomputation, gradient accumulation),
at the optimizer step every trainable parameter's value, gradient and optimizer state exist, and the most a plan can
do is keep one ``1 / devices`` piece of each on a device. With host offload allowed (``offload`` not "none" on a
cluster whose host memory is not the device's: ``cost/offload.py: host_is_device``), the gradients, masters and
optimizer state may live in host memory, and a device keeps at least its piece of the parameters. A budget below the
floor is refused here in a moment, naming the fixes that can help: more devices or offload; a smaller batch, a
shorter sequence, recomputation, accumulation or pipeline stages cannot, since the state does not depend on them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from autoshard.cluster.profile import ClusterProfile
from autoshard.config import OPTIMIZER_STATE_FACTOR, PlanConfig
from autoshard.cost.offload import host_is_device
from autoshard.errors import InfeasibleBudget
from autoshard.notation import format_bytes


@dataclass(frozen=True)
class StateFloor:
    """A model's training state on ``devices`` devices: ``params_bytes`` (every parameter, once), ``state_bytes``
    (parameters, the trainable ones' gradients and optimizer state), and the least one device holds: ``device_bytes``
    (of the state, with the optimizer kept on the device) and ``offload_bytes`` (of the parameters alone, with it in
    host memory; None when the plan may not offload)."""

    devices: int
    params_bytes: int
    state_bytes: int
    offload_bytes: float | None

    @property
    def device_bytes(self) -> float:
        return self.state_bytes / self.devices

    @property
    def least_bytes(self) -> float:
        """What no plan goes below, given what the options allow."""
        return self.device_bytes if self.offload_bytes is None else self.offload_bytes


def state_floor(model: nn.Module, config: PlanConfig, cluster: ClusterProfile, devices: int) -> StateFloor:
    """The floor of ``model``'s training state on ``devices`` devices (see the module docstring)."""
    params = trained = 0
    for p in model.parameters():  # (tied parameters once)
        size = p.numel() * p.element_size()
        params += size
        trained += size if p.requires_grad else 0
    state = params + trained * (1 + OPTIMIZER_STATE_FACTOR[config.optimizer])  # values, gradients, moments
    may_offload = config.offload != "none" and not host_is_device(cluster)
    return StateFloor(devices, params, state, params / devices if may_offload else None)


def refuse_below_floor(
    model: nn.Module, config: PlanConfig, cluster: ClusterProfile, devices: int, name: str = ""
) -> StateFloor | None:
    """Raise :class:`InfeasibleBudget` when ``config.memory_budget`` is below the state floor on ``devices`` (the
    message names the devices and the offload that would hold it); the floor otherwise (None without a budget)."""
    budget = config.memory_budget
    if budget is None:
        return None
    floor = state_floor(model, config, cluster, devices)
    if budget >= floor.least_bytes:
        return floor
    what, n = name or type(model).__name__, devices
    held = floor.state_bytes if floor.offload_bytes is None else floor.params_bytes
    fixes = [f"at least {_devices(held, budget, cluster)}"]
    if floor.offload_bytes is not None:
        head = (
            f"even with its gradients and optimizer state in host memory, its parameters "
            f"({format_bytes(floor.params_bytes)}) sharded over all {n} devices"
        )
    else:
        head = (
            f"its training state ({format_bytes(floor.params_bytes)} of parameters; {format_bytes(floor.state_bytes)} "
            f"with gradients and {config.optimizer} state) sharded over all {n} devices"
        )
        if not host_is_device(cluster) and floor.params_bytes / n <= budget:
            fixes.append(
                "offload='params' (--offload params), which keeps the gradients, masters and optimizer state in host "
                f"memory: {format_bytes(floor.params_bytes / n)} of parameters per device"
            )
    raise InfeasibleBudget(
        f"{what} cannot train on {n} x {format_bytes(budget)}: {head} needs {format_bytes(floor.least_bytes)} per "
        f"device before any activation. Use {' or '.join(fixes)}, or raise the budget; a smaller batch, a shorter "
        "sequence, recomputation, gradient accumulation or pipeline stages cannot help: the state does not depend "
        "on them.",
        int(math.ceil(floor.least_bytes)),
        fixed_bytes=int(math.ceil(floor.least_bytes)),
    )


def _devices(total: float, budget: int, cluster: ClusterProfile) -> str:
    """How many devices of ``budget`` each hold ``total`` bytes sharded, in whole nodes of ``cluster``."""
    need = max(1, math.ceil(total / budget))
    per_node = cluster.devices_per_node
    if need <= per_node:
        return f"{need} devices"
    nodes = math.ceil(need / per_node)
    return f"{need} devices (e.g. cluster '{cluster.name.split(':')[0]}:{nodes}x{per_node}', {nodes * per_node})"


__all__ = ["StateFloor", "refuse_below_floor", "state_floor"]
