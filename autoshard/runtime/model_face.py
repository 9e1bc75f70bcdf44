"""What training loops read off a model, shown by the module ``compile`` returns.

Loops built on Hugging Face's ``Trainer`` (TRL's trainers too) or on Accelerate look at the model before they call
it. The Trainer keeps only the dataset columns that ``forward`` names (``inspect.signature``), finds the label
arguments and whether the model takes loss keywords (``num_items_in_batch``) from its class's ``forward``, and reads
``config``, ``main_input_name`` and ``loss_type``; Accelerate's ``prepare`` (which the Trainer calls) wraps a model
in ``DistributedDataParallel`` unless it was prepared already. The sharded module takes the model's own arguments
and is distributed already, so it says both:

- its class becomes a subclass made for the model, whose ``forward`` carries the model's ``forward`` signature
  (the call itself is the sharded module's own);
- the model's ``config``, ``main_input_name``, ``loss_type``, ``accepts_loss_kwargs``, ``name_or_path`` and
  ``generation_config`` are the module's, where the model has them;
- the model's ``add_model_tags`` (TRL tags the model card with it) is the module's;
- ``gradient_checkpointing_enable`` (the Trainer's ``gradient_checkpointing=True``) warns that the plan chooses
  recomputation itself;
- ``_is_accelerate_prepared`` is True: ``Accelerator.prepare`` returns it as it is, with no DDP and no autocast
  around it (mixed precision is the plan's: ``autoshard/integrations/accelerate.py`` reads the Accelerator's).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from torch import nn

from autoshard.messages import warn

log = logging.getLogger(__name__)

# the model's own methods a loop may call that only read or label the model (TRL tags the model card)
MODEL_METHODS = ("add_model_tags",)
MODEL_ATTRIBUTES = (
    "config",
    "main_input_name",
    "loss_type",
    "accepts_loss_kwargs",
    "name_or_path",
    "generation_config",
)
_FACES: dict[tuple[type, type], type] = {}


def _face_class(base: type, model_cls: type) -> type:
    """``base`` with ``forward`` signed as ``model_cls.forward`` (one class per pair)."""
    key = (base, model_cls)
    if key not in _FACES:
        try:
            signature = inspect.signature(model_cls.forward)
        except (TypeError, ValueError):  # a builtin or C-implemented forward: keep the generic one
            signature = inspect.signature(base.forward)

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return base.forward(self, *args, **kwargs)

        forward.__signature__ = signature  # type: ignore[attr-defined]
        forward.__doc__ = base.forward.__doc__
        forward.__qualname__ = f"{base.__qualname__}.forward"
        _FACES[key] = type(
            base.__name__,
            (base,),
            {
                "forward": forward,
                "__module__": base.__module__,
                "__qualname__": base.__qualname__,
                "_autoshard_model_class": model_cls,
                "gradient_checkpointing_enable": _planned_recomputation,
                "activation_checkpointing_enable": _planned_recomputation,
                **{name: _delegate(name) for name in MODEL_METHODS if hasattr(model_cls, name)},
            },
        )
    return _FACES[key]


def _delegate(name: str) -> Any:
    def method(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.module, name)(*args, **kwargs)

    method.__name__ = name
    return method


def _planned_recomputation(self: nn.Module, *args: Any, **kwargs: Any) -> None:
    """A loop's ``gradient_checkpointing=True`` (``model.gradient_checkpointing_enable()``): the plan decides what is
    recomputed, layer by layer, to fit the memory budget; this changes nothing, and says so."""
    warn(
        log,
        "gradient checkpointing was asked for (gradient_checkpointing=True, or gradient_checkpointing_enable()): "
        "autoshard chooses what to recompute itself, per layer, to fit the memory budget (compile's "
        "memory_budget=; recompute=[module paths] forces it); the request changes nothing",
    )


def wear_model_face(module: nn.Module, model: nn.Module) -> None:
    """Give ``module`` (a ``ShardedModule`` or the lazy one) ``model``'s face (see the module docstring)."""
    # a PEFT model's forward takes (*args, **kwargs) on to its base model, whose signature is the call's (as the
    # Trainer reads it for a PEFT model)
    peft = hasattr(model, "peft_config") and hasattr(model, "get_base_model")
    model_cls = type(model.get_base_model()) if peft else type(model)
    module.__class__ = _face_class(
        type(module).__mro__[0] if not hasattr(type(module), "_autoshard_model_class") else type(module).__mro__[1],
        model_cls,
    )
    for name in MODEL_ATTRIBUTES:
        try:
            value = getattr(model, name)
        except AttributeError:
            continue
        if isinstance(value, nn.Module):
            continue
        object.__setattr__(module, name, value)
    object.__setattr__(module, "_is_accelerate_prepared", True)


def model_class(module: nn.Module) -> type:
    """The class of the model ``module`` wears the face of (its own class when it wears none)."""
    return getattr(type(module), "_autoshard_model_class", type(module))
