"""``autoshard.init_weights`` / ``load_pretrained`` / ``save_pretrained``: one call for every kind of model.

- a module ``autoshard.compile`` returned (``ShardedModule``, ``PipelinedModule``, or the lazy one after its first
  call): its own method, on its shards;
- a model still on the meta device, not sharded yet (before ``compile``, before the lazy module's first call, before
  the first call of ``torch.compile(model, backend="autoshard")``): the call is recorded on the model and run as soon
  as ``compile`` has allocated its shards, before any step reads them;
- an ordinary model, whole in this process: in place (``init_weights`` gives the very tensors a sharded model gets
  for the same seed; ``load_pretrained`` reads the checkpoint, checked the same way).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

from autoshard.errors import InputError
from autoshard.weights.shards import is_unfilled, stand_in_device, stand_in_for_meta

log = logging.getLogger(__name__)

_ATTR = "_autoshard_deferred"


def _has_meta(model: nn.Module) -> bool:
    return any(is_unfilled(t) for t in [*model.parameters(), *model.buffers()])


def _wrapper(model: nn.Module) -> Any:
    """The autoshard module whose methods fill ``model`` (itself, or the lazy module's compiled one), or None."""
    compiled = getattr(model, "_compiled", model) if hasattr(model, "_build") else model
    sharded = compiled is not None and hasattr(compiled, "plan") and hasattr(compiled, "load_pretrained")
    return compiled if sharded else None


def _defer(model: nn.Module, action: tuple[str, Any]) -> None:
    target = getattr(model, "module", model) if hasattr(model, "_build") else model  # the lazy module's model
    target = getattr(target, "_orig_mod", target)  # torch.compile's wrapper: the model it compiles
    target.__dict__.setdefault(_ATTR, []).append(action)
    log.info("autoshard: %s(%r) will run once compile has allocated this rank's shards", *action)
    device = stand_in_device()
    if device is not None:  # torch.compile's backend: dynamo traces the model on the inputs' device first
        made = stand_in_for_meta(target, device)
        log.debug("autoshard: %d meta tensors stand in as one element expanded on %s until compile", made, device)


def take_deferred(model: nn.Module) -> list[tuple[str, Any]]:
    """The calls recorded on ``model`` before it was sharded, in order (and forgotten)."""
    return model.__dict__.pop(_ATTR, [])


def init_weights(model: nn.Module, seed: int = 0) -> None:
    """Initialize ``model`` as its own code does, seeded per tensor name (``autoshard/weights/init.py``)."""
    wrapper = _wrapper(model)
    if wrapper is not None:
        wrapper.init_weights(seed)
    elif _has_meta(model):
        _defer(model, ("init_weights", seed))
    else:
        from autoshard.weights.init import init_weights as run

        run(model, seed)


def load_pretrained(model: nn.Module, path: str | os.PathLike, *, strict: bool = True) -> None:
    """Load a ``save_pretrained`` directory into ``model`` (``autoshard/weights/pretrained.py``)."""
    wrapper = _wrapper(model)
    if wrapper is not None:
        wrapper.load_pretrained(path, strict=strict)
    elif _has_meta(model):
        _defer(model, ("load_pretrained", os.fspath(path)))
    else:
        from autoshard.weights.pretrained import load_pretrained as run

        run(model, path, strict=strict)


def save_pretrained(model: nn.Module, path: str | os.PathLike, *, dtype: torch.dtype | None = None) -> None:
    """Write ``model`` as ``from_pretrained`` reads it, each rank its shards (``autoshard/weights/pretrained.py``)."""
    wrapper = _wrapper(model)
    if wrapper is None and _has_meta(model):
        raise InputError(
            "save_pretrained: the model has no values yet (built on the meta device and not initialized or loaded)"
        )
    from autoshard.weights.pretrained import save_pretrained as run

    if wrapper is not None:
        wrapper.save_pretrained(path, dtype=dtype)
    else:
        run(model, model, path, dtype=dtype)


__all__ = ["init_weights", "load_pretrained", "save_pretrained", "take_deferred"]
