"""Hugging Face's ``Trainer`` (and TRL's trainers, which are Trainers) with a module autoshard compiled.

    trainer = Trainer(model=autoshard.compile(model, mesh), args=TrainingArguments(...), train_dataset=rows)

The module trains as the Trainer calls it: it shows the model's signature, is not wrapped in DDP
(``runtime/model_face.py``), takes ``num_items_in_batch`` as the model does and gives each rank its share of the
loss (``runtime/lazy.py``); ``max_grad_norm`` clips by the global norm (the gradients are DTensors).

What the Trainer does from rank 0 alone cannot be done for a sharded model: it writes ``model.state_dict()`` and
``optimizer.state_dict()`` from the main process. For an autoshard module (any other model keeps the Trainer's
own path) these Trainer methods are replaced, once, when ``compile`` runs in a process that imported
transformers:

- ``_save`` (``save_model``, and the model in each ``checkpoint-N``): every rank writes its shards of a
  ``from_pretrained`` folder (``config.json`` and whole-tensor safetensors, each tensor written once);
- ``_save_optimizer_and_scheduler``: the model's and the optimizer's shards in ``checkpoint-N/autoshard-state``
  (``weights/training_state.py``: DCP, loadable onto any number of ranks), the LR scheduler as the Trainer
  writes it;
- ``_load_from_checkpoint`` / ``_load_optimizer_and_scheduler`` (``resume_from_checkpoint``): that folder read
  back, at the first call for a module planned on its first call;
- ``get_decay_parameter_names``: the weight-decay groups by the model's own parameter names;
- TRL's ``SFTTrainer.compute_loss``: TRL computes the loss outside the model from per-token log-probabilities of
  a fused LM head it patches in; a sharded training program returns the loss alone, so for an autoshard module the
  loss is the model's own (``Trainer.compute_loss``: the same negative log-likelihood, over ``num_items_in_batch``)
  and TRL's per-token metrics (``entropy``, ``mean_token_accuracy``) are not logged (said once);
- ``_wrap_model``: the arguments autoshard cannot honour refused at ``train()`` naming the argument and the fix
  (``deepspeed``, ``fsdp``, ``fp16``, ``load_best_model_at_end``, ``parallelism_config``), and ``bf16=True``
  made the plan's mixed precision (a module not planned yet is planned so; one planned otherwise is refused).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autoshard.errors import InputError
from autoshard.messages import warn
from autoshard.runtime.lazy import LazyShardedModule
from autoshard.runtime.pipelined import PipelinedModule
from autoshard.runtime.sharded_module import ShardedModule
from autoshard.weights.training_state import load_training_state, save_training_state, unwrap_optimizer

log = logging.getLogger(__name__)

STATE_DIR = "autoshard-state"  # in a checkpoint-N folder: the model's and the optimizer's shards (DCP)
_MARK = "_autoshard_original"


def is_autoshard_module(model: Any) -> bool:
    return isinstance(model, (ShardedModule, LazyShardedModule, PipelinedModule))


def _replace(cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = getattr(cls, name, None)
    if original is None:  # a Trainer without this method: its path is not taken
        log.debug("autoshard: transformers.Trainer has no %s; not replaced", name)
        return
    if getattr(original, _MARK, None) is not None:
        return
    new = functools.wraps(original)(make(original))
    setattr(new, _MARK, original)
    setattr(cls, name, new)


def install() -> None:
    """Replace the Trainer methods above for autoshard modules (idempotent)."""
    from transformers import Trainer

    _replace(Trainer, "_wrap_model", _wrap_model)
    _replace(Trainer, "get_decay_parameter_names", _decay_names)
    _replace(Trainer, "_save", _save)
    _replace(Trainer, "_save_optimizer_and_scheduler", _save_optimizer_and_scheduler)
    _replace(Trainer, "_load_from_checkpoint", _load_from_checkpoint)
    _replace(Trainer, "_load_optimizer_and_scheduler", _load_optimizer_and_scheduler)
    if "trl" in sys.modules:
        from trl import SFTTrainer

        _replace(SFTTrainer, "compute_loss", _sft_loss)


# --------------------------------------------------------------------------- arguments
def check_arguments(args: Any, model: nn.Module) -> None:
    """Refuse what autoshard cannot honour; make ``bf16=True`` the plan's mixed precision."""
    if isinstance(model, PipelinedModule) or getattr(model, "_pipelined", False):
        raise InputError(
            "the Trainer calls the model's forward once per micro-batch; a pipelined module trains with "
            "step() over its micro-batches. Compile without a 'pp' mesh axis and without "
            "pipeline='auto' for the Trainer"
        )
    if isinstance(model, ShardedModule):
        raise InputError(
            "the Trainer passes each process its own rows and calls the model as it is called: compile "
            "the model for it without example_inputs (autoshard.compile(model, mesh)), which plans at "
            "the first call from those rows"
        )
    model.split_batch_over_every_rank("the Trainer's data loader")
    refused = {
        "deepspeed": "DeepSpeed shards the model itself; autoshard has sharded it already: drop deepspeed=",
        "fsdp": "FSDP shards the model itself; autoshard has sharded it already (the plan may be FSDP's: "
        "compile(..., recipe='fsdp')): drop fsdp=",
        "fp16": "float16 needs loss scaling, which autoshard does not do: use bf16=True",
        "load_best_model_at_end": "reloading the best checkpoint into the shards is not built yet: set it False "
        "and load the best checkpoint folder's autoshard-state with "
        "autoshard.weights.training_state.load_training_state",
        "parallelism_config": "Accelerate's parallelism config shards the model itself; the mesh given to "
        "autoshard.compile says how it is sharded: drop parallelism_config=",
    }
    for name, why in refused.items():
        value = getattr(args, name, None)
        if value and value not in ("", [], "no"):
            raise InputError(f"TrainingArguments({name}={value!r}) with an autoshard module: {why}")
    if getattr(args, "torch_compile", False):
        warn(
            log,
            "TrainingArguments(torch_compile=True): autoshard compiles each rank's program itself (compile's "
            "backend=); the Trainer's torch.compile is not applied",
        )
    if getattr(args, "bf16", False):
        _bf16(model)


def _bf16(model: nn.Module) -> None:
    if isinstance(model, LazyShardedModule) and model._compiled is None:
        if model.plan_options.get("mixed_precision") in (None, "bf16", "bfloat16"):
            model.plan_options["mixed_precision"] = "bf16"
            model.plan_options.setdefault("precision_policy", "autocast")  # what bf16=True means to the Trainer
            log.info(
                "autoshard: TrainingArguments(bf16=True): planned with mixed_precision='bf16' (bf16 compute, "
                "fp32 parameters, gradients and optimizer state) under precision_policy=%r",
                model.plan_options["precision_policy"],
            )
            return
    plan = model.plan
    if plan.mixed_precision not in ("bfloat16", "bf16"):
        raise InputError(
            f"TrainingArguments(bf16=True), but the module was planned with mixed_precision="
            f"{plan.mixed_precision or None!r}: compile with mixed_precision='bf16', or drop bf16=True"
        )


def _wrap_model(original: Callable[..., Any]) -> Callable[..., Any]:
    def wrap(self: Any, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        if not is_autoshard_module(model):
            return original(self, model, training, dataloader)
        install()  # a trainer class imported after compile (TRL's) gets its replacements before the first step
        check_arguments(self.args, model)
        return model  # distributed already: no DDP, no DataParallel

    return wrap


def _decay_names(original: Callable[..., Any]) -> Callable[..., Any]:
    def names(self: Any, model: nn.Module) -> list[str]:
        return original(self, model.module if is_autoshard_module(model) else model)

    return names


# --------------------------------------------------------------------------- checkpoints
def _save(original: Callable[..., Any]) -> Callable[..., Any]:
    def save(self: Any, output_dir: str | None = None, state_dict: Any = None) -> None:
        if not is_autoshard_module(self.model):
            return original(self, output_dir, state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if state_dict is not None:
            raise InputError(
                "Trainer.save_model with a state_dict: an autoshard module writes its own shards; call it without one"
            )
        self.model.save_pretrained(output_dir)  # every rank: its shards, consolidated into whole tensors
        if self.args.should_save:
            from transformers.trainer import TRAINING_ARGS_NAME

            processing = getattr(self, "processing_class", None) or getattr(self, "tokenizer", None)
            if processing is not None:
                processing.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        return None

    return save


def _save_optimizer_and_scheduler(original: Callable[..., Any]) -> Callable[..., Any]:
    def save(self: Any, output_dir: str) -> None:
        if not is_autoshard_module(self.model):
            return original(self, output_dir)
        save_training_state(_compiled(self.model), self.optimizer, os.path.join(output_dir, STATE_DIR))
        if self.args.should_save and self.lr_scheduler is not None:
            from transformers.trainer import SCHEDULER_NAME

            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
        return None

    return save


def _compiled(model: nn.Module) -> nn.Module:
    return model.compiled if isinstance(model, LazyShardedModule) else model


def _load_from_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    def load(self: Any, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        target = self.model if model is None else model
        if not is_autoshard_module(target):
            return original(self, resume_from_checkpoint, model)
        if not os.path.isdir(os.path.join(resume_from_checkpoint, STATE_DIR)):
            raise InputError(
                f"resume_from_checkpoint={resume_from_checkpoint!r} has no {STATE_DIR}/ folder: it was not written "
                "by a Trainer training an autoshard module. To start from its weights, load them into the model "
                "before autoshard.compile (from_pretrained), or into the module (load_pretrained), and train "
                "without resume_from_checkpoint"
            )
        log.info(
            "autoshard: the model's shards are read with the optimizer's from %s/%s", resume_from_checkpoint, STATE_DIR
        )
        return None

    return load


def _load_optimizer_and_scheduler(original: Callable[..., Any]) -> Callable[..., Any]:
    def load(self: Any, checkpoint: str | None) -> None:
        if not is_autoshard_module(self.model):
            return original(self, checkpoint)
        if checkpoint is None:
            return None
        path = os.path.join(checkpoint, STATE_DIR)
        optimizer = self.optimizer

        def read(compiled: nn.Module) -> None:
            compiled.adopt_optimizer(unwrap_optimizer(optimizer))  # the sharded parameters, before reading their state
            load_training_state(compiled, optimizer, path)

        if isinstance(self.model, LazyShardedModule):
            self.model.when_compiled(read)
        else:
            read(self.model)
        from transformers.trainer import SCHEDULER_NAME

        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
        return None

    return load


def _sft_loss(original: Callable[..., Any]) -> Callable[..., Any]:
    def compute_loss(
        self: Any,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        if not is_autoshard_module(self.model):
            return original(self, model, inputs, return_outputs, num_items_in_batch)
        from transformers import Trainer

        if not getattr(self, "_autoshard_said_metrics", False):
            self._autoshard_said_metrics = True
            warn(
                log,
                "TRL's %s with an autoshard module: the loss is the model's own (the same negative "
                "log-likelihood); TRL's per-token metrics (entropy, mean_token_accuracy) need per-token outputs "
                "a sharded training program does not return, and are not logged",
                type(self).__name__,
            )
        inputs = {**inputs, "use_cache": False}
        return Trainer.compute_loss(
            self, model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )

    return compute_loss
