"""Lightning (``lightning`` 2.x: the ``Trainer`` and ``Fabric``) training a model with autoshard, CPU (gloo) or GPU.

The Trainer, one line (the ``LightningModule`` stays as it is for DDP; it needs no ``configure_model``)::

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=AutoshardStrategy())      # compile options: kwargs

Fabric, and the Trainer's own ``ModelParallelStrategy``, with autoshard's ``parallelize`` passed as it is::

    strategy = lightning.fabric.strategies.ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=2,
                                                                  tensor_parallel_size=1)
    def configure_model(self):                  # a LightningModule under lightning.pytorch's ModelParallelStrategy
        self.model = parallelize(self.model, self.device_mesh)

``parallelizer(backend="eager", memory_budget="2GiB", ...)`` is ``parallelize`` with ``autoshard.compile``'s options.

What is compiled is a module whose ``forward`` returns the loss (a Hugging Face model called with ``labels``, or a
plain module returning its loss), called with this rank's rows: it is planned at its first call
(``autoshard/runtime/lazy.py``), and the loss and gradients it returns are the global batch's.
``AutoshardStrategy`` compiles the ``LightningModule``'s one child with parameters (``module="name"`` picks
another), unless ``configure_model`` did. Its data loaders give every process its own rows, as DDP's do, and the
mesh is Lightning's (``data_parallel`` = nodes, ``tensor_parallel`` = processes per node: the hardware's shape,
planned over as autoshard sees fit). Under ``parallelize`` the rows follow Lightning's sampler: split over the
``data_parallel`` axis, the same on ``tensor_parallel``.

Honoured by ``AutoshardStrategy``: ``precision="32-true"``; ``"bf16-mixed"`` (the plan's mixed precision: bf16
compute, fp32 parameters, gradients and optimizer state; Lightning's autocast is not applied around it);
``gradient_clip_val`` by norm or by value (on the sharded gradients: the global norm); ``accumulate_grad_batches``;
``sync_batchnorm`` (training batch norm is the global batch's already); an optimizer from ``configure_optimizers``
(re-pointed at the sharded parameters when they are made, so that clipping sees them at the first step) and LR
schedulers; checkpoints (``ModelCheckpoint``, ``trainer.save_checkpoint``, ``ckpt_path=``): a folder whose model
and optimizer state is a ``torch.distributed.checkpoint`` written by every rank (``weights/training_state.py``:
loadable onto any number of ranks), the rest (loops, callbacks, schedulers) in ``meta.pt``; a resumed run reads it
into the shards at its first step.

Refused, before the first step, naming the option and the fix (``InputError``): other precisions ("16-mixed",
"16-true", "bf16-true", "64-true", plugins); more than one optimizer; a module compiled with ``example_inputs`` or
into pipeline stages; a ``LightningModule`` whose module to compile is ambiguous; parameters already DTensors
(``fully_shard``, ``parallelize_module``); ``parallelize`` without a device mesh (another strategy); a module called
under ``torch.autocast`` (Fabric's ``precision="bf16-mixed"``: use ``parallelizer(mixed_precision="bf16")``).
Not checked under ``parallelize`` (it sees the model and the mesh only): Trainer options; an optimizer built before
the first call is re-pointed at its first ``step``, so clipping by its parameters at the first step finds no
gradients when the plan shards the parameters (``AutoshardStrategy`` re-points it when the shards are made).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import autoshard
from autoshard.errors import InputError, UsageError
from autoshard.runtime.lazy import LazyShardedModule
from autoshard.runtime.pipelined import PipelinedModule
from autoshard.runtime.sharded_module import ShardedModule
from autoshard.weights.training_state import load_training_state, save_training_state, unwrap_optimizer

log = logging.getLogger(__name__)

BATCH_AXIS = "data_parallel"  # Lightning's mesh: ("data_parallel", "tensor_parallel"); its samplers split the first
META = "meta.pt"  # in a checkpoint folder: what is not the model's or the optimizer's state (rank 0 writes it)


# --------------------------------------------------------------------------- parallelize_fn
def parallelizer(**options: Any) -> Callable[[nn.Module, DeviceMesh], nn.Module]:
    """A ``parallelize_fn`` (``(model, device_mesh) -> model``) compiling with ``autoshard.compile``'s ``options``."""

    def parallelize_fn(model: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return compile_for_lightning(model, device_mesh, options)

    parallelize_fn.__doc__ = parallelize.__doc__
    return parallelize_fn


def parallelize(model: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
    """Lightning's ``parallelize_fn``: ``model`` compiled by autoshard on ``device_mesh``, planned at its first call
    from each rank's rows (split over the mesh's ``data_parallel`` axis, as Lightning's samplers split them).
    ``model``'s ``forward`` returns the loss; the module returned gives the global batch's loss and gradients."""
    return compile_for_lightning(model, device_mesh, {})


def compile_for_lightning(model: nn.Module, device_mesh: DeviceMesh | None, options: dict[str, Any]) -> nn.Module:
    """``autoshard.compile(model, device_mesh, **options)`` without example inputs, for a Lightning loop; an
    autoshard module already (``configure_model`` runs again for each ``fit``/``validate``) is returned as it is."""
    if isinstance(model, (LazyShardedModule, ShardedModule, PipelinedModule)):
        return model
    if device_mesh is None:
        raise InputError(
            "autoshard's parallelize needs the device mesh of a ModelParallelStrategy (self.device_mesh "
            "in configure_model is None under other strategies): use Trainer(strategy=autoshard."
            "integrations.lightning.AutoshardStrategy()), or lightning's ModelParallelStrategy"
        )
    if isinstance(model, pl.LightningModule):
        raise InputError(
            f"parallelize got the LightningModule {type(model).__name__}: pass the module whose forward "
            "returns the loss (self.model = parallelize(self.model, self.device_mesh)), or use "
            "AutoshardStrategy(), which finds it"
        )
    placed = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    if placed:
        raise InputError(
            f"parameters {placed[:3]} are DTensors already (fully_shard or parallelize_module was "
            "applied): autoshard lays out every parameter itself; give it the plain model"
        )
    options = dict(options)
    names = tuple(device_mesh.mesh_dim_names or ())
    if "pp" in names or options.get("pipeline") == "auto":
        raise InputError(
            "Lightning calls the model's forward once per batch; a pipelined module trains with step() "
            "over micro-batches: use a mesh without a 'pp' axis, and no pipeline='auto'"
        )
    if BATCH_AXIS in names:
        options.setdefault("batch_axes", (BATCH_AXIS,))
    device_mesh = planning_mesh(device_mesh, options.get("batch_axes"))
    names = tuple(device_mesh.mesh_dim_names or ())
    sharded = autoshard.compile(model, device_mesh, **options)
    assert isinstance(sharded, LazyShardedModule)  # no example inputs: planned at the first call
    sharded.register_forward_pre_hook(_refuse_autocast)
    log.info(
        "autoshard: %s compiled for Lightning on mesh %s, planned at its first call",
        type(model).__name__,
        dict(zip(names, device_mesh.shape)),
    )
    return sharded


def planning_mesh(mesh: DeviceMesh, batch_axes: Any) -> DeviceMesh:
    """The mesh without its axes of size 1 that do not split the batch (Lightning's mesh on one node is
    (data_parallel=1, tensor_parallel=N)): they hold no choice, and the plan is made on the axes that do."""
    names = tuple(mesh.mesh_dim_names or ())
    needed = (
        () if batch_axes in (None, "all") else ((batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes))
    )
    kept = tuple(n for n, size in zip(names, mesh.shape) if size > 1 or n in needed)
    if len(names) != mesh.ndim or not kept or kept == names:
        return mesh
    return mesh[kept[0]] if len(kept) == 1 else mesh[kept]


def _refuse_autocast(module: nn.Module, args: Any) -> None:
    """Forward pre-hook: the compiled program runs in its planned precision; an ambient autocast would recast it."""
    device = module.mesh.device_type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        raise InputError(
            f"the autoshard module is called under torch.autocast({device!r}, {dtype}) (Fabric's or the Trainer's "
            "precision='bf16-mixed' / '16-mixed' around lightning.*.ModelParallelStrategy): its program runs in the "
            "precision it was planned for. Use precision='32-true' with parallelizer(mixed_precision='bf16') (bf16 "
            "compute, fp32 parameters and optimizer state), or the Trainer's AutoshardStrategy, which makes "
            "'bf16-mixed' the plan's"
        )


# --------------------------------------------------------------------------- the Trainer's strategy
class AutoshardStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` whose parallelism is autoshard's plan (see the module docstring).

    ``module``: the ``LightningModule`` attribute to compile (default: its one child with parameters).
    ``data_parallel_size`` / ``tensor_parallel_size``: the mesh (default: nodes x processes per node).
    ``**compile_options``: ``autoshard.compile``'s (``backend``, ``memory_budget``, ``mixed_precision``, ...).
    """

    def __init__(
        self,
        module: str | None = None,
        data_parallel_size: int | str = "auto",
        tensor_parallel_size: int | str = "auto",
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **compile_options: Any,
    ) -> None:
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        if "batch_axes" in compile_options:
            raise InputError(
                "AutoshardStrategy(batch_axes=...): its data loaders give every process its own rows, so "
                "the batch is split over every rank; drop batch_axes"
            )
        self._module_name = module
        self._compile_options = compile_options
        self._sharded: LazyShardedModule | None = None

    @property
    def sharded(self) -> LazyShardedModule:
        """The autoshard module being trained (after ``setup``)."""
        if self._sharded is None:
            raise UsageError("AutoshardStrategy.sharded is set up by the Trainer (fit, validate, test, predict)")
        return self._sharded

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The samplers split the rows over the compiled module's batch axes (every rank, unless ``configure_model``
        compiled it with ``parallelize``: the ``data_parallel`` axis)."""
        if self._sharded is None:
            return {"num_replicas": self.world_size, "rank": self.global_rank}
        mesh, axes = self._sharded.mesh, self._sharded.batch_axes
        coordinate = mesh.get_coordinate() or [0] * mesh.ndim
        rank = 0
        for a in axes:
            rank = rank * mesh.shape[a] + coordinate[a]
        return {"num_replicas": math.prod(mesh.shape[a] for a in axes), "rank": rank}

    def setup(self, trainer: pl.Trainer) -> None:
        """Lightning's ``ModelParallelStrategy.setup`` with autoshard's compile in place of ``configure_model``'s
        parallelism: the Trainer's options checked, the module compiled, the optimizers made and re-pointed at the
        shards as soon as the first step makes them."""
        assert self.model is not None and self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        bf16 = check_precision(self.precision_plugin)
        if self._layer_sync is not None:
            log.info(
                "autoshard: Trainer(sync_batchnorm=True): training batch norm is the global batch's already "
                "(SyncBatchNorm's statistics); no module is converted"
            )
            self._layer_sync = None
        self._sharded = self._compile(self.lightning_module)
        if bf16:
            self._plan_bf16(self._sharded)
            self.precision_plugin = Precision()  # no autocast around the step: the plan's precision is bf16
        if not any(p.device.type == "meta" for p in self.model.parameters()):  # (shards are made on the device)
            self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if len(self.optimizers) > 1:
                raise InputError(
                    f"configure_optimizers returned {len(self.optimizers)} optimizers: AutoshardStrategy "
                    "trains one module with one optimizer (param groups may differ); use one "
                    "optimizer with several param groups"
                )
            self._sharded.when_compiled(self._adopt_optimizers)
        self.setup_precision_plugin()

    def _compile(self, lm: pl.LightningModule) -> LazyShardedModule:
        """The module to train: an autoshard module ``configure_model`` made, else the chosen child compiled."""
        made = [
            (n, m) for n, m in lm.named_children() if isinstance(m, (LazyShardedModule, ShardedModule, PipelinedModule))
        ]
        if len(made) > 1:
            raise InputError(
                f"{type(lm).__name__} holds {len(made)} autoshard modules ({[n for n, _ in made]}): "
                "AutoshardStrategy trains one; compile one module"
            )
        if made:
            name, sharded = made[0]
            if isinstance(sharded, ShardedModule):
                raise InputError(
                    f"{type(lm).__name__}.{name} was compiled with example_inputs (global shapes): the "
                    "Trainer gives each process its own rows; compile without example_inputs (or let "
                    "AutoshardStrategy compile it)"
                )
        else:
            name = self._choose_child(lm)
            sharded = compile_for_lightning(
                getattr(lm, name), self.device_mesh, {**self._compile_options, "batch_axes": "all"}
            )
            setattr(lm, name, sharded)
        if not isinstance(sharded, LazyShardedModule) or not sharded.batch_axes:
            raise InputError(
                f"{type(lm).__name__}.{name} is pipelined: Lightning calls its forward once per batch; "
                "compile it without a 'pp' mesh axis and without pipeline='auto'"
            )
        self._init_meta(sharded)
        log.info(
            "autoshard: AutoshardStrategy trains %s.%s (%s) on mesh %s",
            type(lm).__name__,
            name,
            type(sharded.module).__name__,
            dict(zip(sharded.mesh.mesh_dim_names or (), sharded.mesh.shape)),
        )
        return sharded

    def _choose_child(self, lm: pl.LightningModule) -> str:
        if self._module_name is not None:
            child = getattr(lm, self._module_name, None)
            if not isinstance(child, nn.Module):
                raise InputError(
                    f"AutoshardStrategy(module={self._module_name!r}): {type(lm).__name__} has no such "
                    f"submodule; its children are {[n for n, _ in lm.named_children()]}"
                )
            return self._module_name
        owners = [n for n, m in lm.named_children() if any(True for _ in m.parameters())]
        if len(owners) != 1:
            raise InputError(
                f"AutoshardStrategy compiles the module whose forward returns the loss; {type(lm).__name__} has "
                f"{len(owners)} children with parameters ({owners}): name it, AutoshardStrategy(module='model')"
            )
        return owners[0]

    def _init_meta(self, sharded: LazyShardedModule) -> None:
        """A model built on the meta device (``trainer.init_module(empty_init=True)``) gets its own initialization
        on its shards, seeded alike on every rank (Lightning's strategies materialize it with ``reset_parameters``)."""
        if any(p.device.type == "meta" for p in sharded.module.parameters()):
            seed = int(self.broadcast(torch.initial_seed() % 2**31))
            log.info("autoshard: the model was built on the meta device: initialized on its shards with seed %d", seed)
            sharded.init_weights(seed)

    def _plan_bf16(self, sharded: LazyShardedModule) -> None:
        given = sharded.plan_options.get("mixed_precision")
        if given not in (None, "bf16", "bfloat16"):
            raise InputError(
                f"Trainer(precision='bf16-mixed'), but AutoshardStrategy was given mixed_precision="
                f"{given!r}: drop one of them"
            )
        if is_compiled(sharded):
            if sharded.plan.mixed_precision not in ("bf16", "bfloat16"):
                raise InputError(
                    "Trainer(precision='bf16-mixed'), but the module was planned in another precision "
                    "by an earlier run: compile it again, or use the earlier run's precision"
                )
            return
        sharded.plan_options["mixed_precision"] = "bf16"
        sharded.plan_options.setdefault("precision_policy", "autocast")  # Lightning's bf16-mixed is autocast
        log.info(
            "autoshard: Trainer(precision='bf16-mixed') is the plan's mixed precision (bf16 compute, fp32 "
            "parameters, gradients and optimizer state) under precision_policy=%r",
            sharded.plan_options["precision_policy"],
        )

    def _adopt_optimizers(self, compiled: nn.Module) -> None:
        for optimizer in self.optimizers:
            compiled.adopt_optimizer(unwrap_optimizer(optimizer))

    # ----------------------------------------------------------------------- checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Nothing here: ``save_checkpoint`` writes the model's shards itself, with the optimizer's."""
        return {}

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {}

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
    ) -> None:
        """A folder: the model's and the optimizer's shards (DCP, every rank) and the rest in ``meta.pt``."""
        if storage_options is not None:
            raise InputError(
                "AutoshardStrategy writes checkpoints with torch.distributed.checkpoint: "
                "save_checkpoint(..., storage_options=...) is not taken; drop it"
            )
        path = Path(self.broadcast(os.fspath(filepath)))
        sharded = self.sharded
        if not is_compiled(sharded):
            raise InputError(
                "a checkpoint before the first training step: the model is laid out (and its shards made) "
                "at its first call; save after a step"
            )
        if self.global_rank == 0 and path.is_file():  # a file of an earlier run under this name
            path.unlink()
        self.barrier()
        path.mkdir(parents=True, exist_ok=True)
        checkpoint = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        if self.optimizers:
            save_training_state(sharded.compiled, self.optimizers[0], path)
        else:
            dcp.save({"model": get_model_state_dict(sharded.compiled)}, checkpoint_id=os.fspath(path))
        if self.global_rank == 0:
            torch.save(checkpoint, path / META)
        self.barrier()

    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        """The loops', callbacks' and schedulers' state now; the model's and the optimizer's read into the shards
        when they exist (at the first step of a module not planned yet)."""
        path = Path(self.broadcast(os.fspath(checkpoint_path)))
        if not (path / META).is_file() or not (path / ".metadata").is_file():
            raise InputError(
                f"ckpt_path={os.fspath(path)!r} is not a checkpoint AutoshardStrategy wrote (a folder "
                f"with {META} and a torch.distributed.checkpoint): to start from a model's weights, "
                "load them into the model before fit, and pass no ckpt_path"
            )
        metadata = torch.load(path / META, weights_only=weights_only)
        optimizers = list(self.optimizers)

        def read(compiled: nn.Module) -> None:
            if optimizers:
                compiled.adopt_optimizer(unwrap_optimizer(optimizers[0]))
                load_training_state(compiled, optimizers[0], path)
            else:
                state = {"model": get_model_state_dict(compiled)}
                dcp.load(state, checkpoint_id=os.fspath(path))
                set_model_state_dict(compiled, state["model"])
            log.info("autoshard: model%s state read from %s", " and optimizer" if optimizers else "", path)

        self.sharded.when_compiled(read)
        return metadata


def is_compiled(module: LazyShardedModule) -> bool:
    """Whether the lazy module has been planned (its first call has run)."""
    try:
        _ = module.compiled
    except RuntimeError:
        return False
    return True


def check_precision(precision: Precision) -> bool:
    """Refuse a Trainer precision autoshard cannot honour; True for ``bf16-mixed``, which becomes the plan's."""
    bf16 = isinstance(precision, MixedPrecision) and precision.precision == "bf16-mixed"
    if not bf16 and type(precision) is not Precision:
        name = getattr(precision, "precision", type(precision).__name__)
        why = (
            "float16 needs loss scaling, which autoshard does not do"
            if "16" in str(name) and "bf16" not in str(name)
            else "autoshard keeps fp32 parameters, gradients and optimizer state and plans the compute precision"
        )
        raise InputError(
            f"Trainer(precision={name!r}) with AutoshardStrategy: {why}; use precision='32-true', or "
            "'bf16-mixed' (the plan's mixed precision: bf16 compute, fp32 parameters and state)"
        )
    return bf16
