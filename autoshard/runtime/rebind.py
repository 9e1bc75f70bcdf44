"""Optimizers built before the parameters were sharded keep working.

``compile`` replaces each parameter by a new ``nn.Parameter`` holding a DTensor (as ``fully_shard`` does; a
plain tensor cannot become a DTensor in place: ``torch.utils.swap_tensors`` refuses classes with other slots).
An optimizer made before that, the ordinary order in a training script and the only order for a model
compiled on its first call, still holds the old objects. ``rebind_optimizers`` registers an optimizer step
pre-hook (public ``torch.optim`` API) that, at each optimizer's first step after the replacement, puts the new
parameters in its param groups in place of the old ones. The old objects keep no storage (their data is
emptied when replaced), so a stale use fails loudly rather than training a copy.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autoshard.errors import InputError

log = logging.getLogger(__name__)


def rebind_optimizers(
    owner: object, replaced: Mapping[int, tuple[nn.Parameter, nn.Parameter]]
) -> Callable[[torch.optim.Optimizer], None]:
    """At the next step of any optimizer holding an old parameter (id -> (old, new)), swap in the new one.
    The hook lives as long as ``owner`` (the sharded module). Returns the swap itself, to apply to an optimizer
    now (before loading its state from a checkpoint)."""
    table = dict(replaced)

    def swap(optimizer: torch.optim.Optimizer) -> None:
        swapped = 0
        for group in optimizer.param_groups:
            params = group["params"]
            if not any(id(p) in table and table[id(p)][0] is p for p in params):
                continue
            fresh = []
            for p in params:
                pair = table.get(id(p))
                if pair is not None and pair[0] is p:
                    if p in optimizer.state and optimizer.state[p]:
                        raise InputError(
                            f"{type(optimizer).__name__} holds state for a parameter autoshard has since sharded; "
                            "build the optimizer before its first step on the original parameters or after "
                            "autoshard.compile (sharded.parameters())"
                        )
                    p = pair[1]
                    swapped += 1
                fresh.append(p)
            group["params"] = fresh
        if swapped:
            log.info(
                "autoshard: %s now steps the %d sharded parameters it was built with", type(optimizer).__name__, swapped
            )

    if table:
        handle = register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: swap(optimizer))
        weakref.finalize(owner, handle.remove)
    return swap


def retire(old: nn.Parameter) -> None:
    """Free a replaced parameter's storage (the sharded copy holds its values now)."""
    if old.device.type == "meta":
        return  # nothing to free (and, under LocalTensorMode, no plain tensor to swap in)
    with torch.no_grad():
        old.data = torch.empty(0, dtype=old.dtype, device=old.device)
    old.grad = None
