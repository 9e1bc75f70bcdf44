"""Accelerate (``accelerator.prepare(sharded, optimizer, dataloader)``, ``accelerator.backward(loss)``) with a module
autoshard compiled, launched by ``accelerate launch`` or ``torchrun``.

The module says it is prepared already (``runtime/model_face.py``), so ``prepare`` returns it as it is: no DDP,
no autocast, no device move. ``backward`` is ``loss.backward()`` (divided by the accumulation steps),
``clip_grad_norm_`` clips by the global norm (the gradients are DTensors), and the optimizer ``prepare`` wraps
steps the sharded parameters. Two things an Accelerator decides are the plan's, read when the module is planned
(at its first call: ``loop_defaults``):

- its data loaders give every process its own rows (they shard over all processes): the global batch is every
  rank's rows, over every mesh axis (a (dp, tp) mesh too);
- its mixed precision (``Accelerator(mixed_precision="bf16")``, ``accelerate launch --mixed_precision bf16``, the
  Trainer's ``bf16=True``) becomes the plan's, unless compile was given one; ``fp16`` is refused (it needs loss
  scaling, which autoshard does not do).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from autoshard.errors import InputError

log = logging.getLogger(__name__)


def accelerator_state() -> Any:
    """The process's ``AcceleratorState`` once an ``Accelerator`` (or a Trainer) made one, else None."""
    if "accelerate" not in sys.modules:
        return None
    from accelerate.state import AcceleratorState, is_initialized

    return AcceleratorState() if is_initialized() else None


def loop_defaults(module: Any) -> None:
    """What the process's Accelerator decides, applied to a lazy module about to be planned."""
    state = accelerator_state()
    if state is None:
        return
    if state.num_processes > 1:
        module.split_batch_over_every_rank("Accelerate's data loader (an Accelerator, or a Trainer, in this process)")
    precision = str(state.mixed_precision)
    if precision == "fp16":
        raise InputError(
            "the Accelerator's mixed_precision is 'fp16', which needs loss scaling autoshard does not do: "
            "use 'bf16' (Accelerator(mixed_precision='bf16'), TrainingArguments(bf16=True))"
        )
    if precision == "bf16":
        given = module.plan_options.get("mixed_precision")
        if given is None:
            module.plan_options["mixed_precision"] = "bf16"
            module.plan_options.setdefault("precision_policy", "autocast")  # the Accelerator's bf16 is autocast
            log.info(
                "autoshard: the Accelerator's mixed_precision='bf16' is the plan's (bf16 compute, fp32 "
                "parameters, gradients and optimizer state) under precision_policy=%r",
                module.plan_options["precision_policy"],
            )
