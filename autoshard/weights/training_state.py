"""A training run's state (the model's shards and its optimizer's) in a ``torch.distributed.checkpoint`` folder.

Every rank writes its own shards, keyed by the model's own parameter names (``get_state_dict`` through the sharded
module's ``_fqn_modifiers``), so the folder loads onto any number of ranks and any plan: DCP reshards on load.
Loading needs the optimizer's state to exist (its layout is what DCP reads into): ``get_state_dict`` makes it
with a step at learning rate 0. The integrations (``autoshard/integrations/``) call these for the trainers'
checkpoint folders; a loop of one's own can too.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from autoshard.errors import InputError

log = logging.getLogger(__name__)


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a wrapper (Accelerate's ``AcceleratedOptimizer``, itself an ``Optimizer`` whose
    ``step`` skips accumulation micro-steps; Lightning's)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _allocate_state(opt: torch.optim.Optimizer) -> None:
    """Make the optimizer's state (the layout DCP reads into) with a step of zero gradients at learning rate 0, as
    ``get_state_dict`` does, but through the optimizer class's own ``step``: a loop may have wrapped the instance's
    (Accelerate's skips it on an accumulation micro-step, which left the state empty and the checkpoint's unread)."""
    params = [p for group in opt.param_groups for p in group["params"]]
    if opt.state or any(p.grad is not None for p in params):
        return
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    lrs = [group["lr"] for group in opt.param_groups]
    for group in opt.param_groups:
        group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    type(opt).step(opt)
    for group, lr in zip(opt.param_groups, lrs):
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    if not opt.state and any(p.requires_grad for p in params):
        raise InputError(
            f"{type(opt).__name__} made no state from a step; autoshard cannot read its checkpointed state into it"
        )


def save_training_state(module: nn.Module, optimizer: Any, path: str | os.PathLike) -> None:
    """Write ``module``'s parameters and ``optimizer``'s state into the DCP folder ``path``; every rank calls it."""
    model_state, optim_state = get_state_dict(module, unwrap_optimizer(optimizer))
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=os.fspath(path))
    log.info("autoshard: model and optimizer state written to %s", os.fspath(path))


def load_training_state(module: nn.Module, optimizer: Any, path: str | os.PathLike) -> None:
    """Read a ``save_training_state`` folder (of any mesh and plan) into ``module``'s shards and ``optimizer``'s
    state; every rank calls it."""
    path = os.fspath(path)
    if not os.path.exists(os.path.join(path, ".metadata")):
        raise InputError(
            f"{path} is not a complete autoshard training-state checkpoint (no .metadata): it was not "
            "written, or its writing was interrupted; resume from another checkpoint"
        )
    opt = unwrap_optimizer(optimizer)
    _allocate_state(opt)
    model_state, optim_state = get_state_dict(module, opt)
    state: dict[str, Any] = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(module, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    log.info("autoshard: model and optimizer state read from %s", path)
