"""The public entry points: ``autoshard.plan`` and ``autoshard.compile``."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autoshard.cluster.profile import ClusterProfile
from autoshard.dispatch import compile_and_report, compile_lazily, plan_only
from autoshard.inputs import Call
from autoshard.integrations import install_loaded
from autoshard.plans.plan import Plan
from autoshard.runtime.lazy import LazyShardedModule
from autoshard.runtime.pipelined import PipelinedModule
from autoshard.runtime.sharded_module import ShardedModule
from autoshard.weights.shards import restore_meta

log = logging.getLogger(__name__)


def plan(
    model: nn.Module | str | Any,
    mesh: DeviceMesh | Sequence[int] | Mapping[str, int] | None = None,
    example_inputs: Sequence[Any] | None = None,
    *,
    cluster: str | ClusterProfile | None = None,
    memory_budget: int | str | None = None,
    constraints: Mapping[str, Any] | None = None,
    seq: int | None = None,
    global_batch: int | None = None,
    progress: Any = None,
    pipeline: str = "none",
    microbatches: int | None = None,
    **options: Any,
) -> Plan:
    """Plan ``model`` without running it.

    Two ways in:

    - ``plan(module, mesh, example_inputs)``: a DeviceMesh of this process's (possibly fake) group; the memory
      budget is only what you pass. A model with a ``nn.ModuleList`` of 6 or more identical layers has three of
      them captured, standing for all (costs and memory count every layer; ``Plan.sampled_layers`` says so);
      ``sample_layers=None`` captures every layer, an int that many. ``compile`` always captures every layer.
    - ``plan("llama3-70b", cluster="h100-sxm:128x8", seq=8192, global_batch=512)``: a zoo name, a Hugging Face
      config.json path or a module with example inputs, for a cluster this process need not be part of. A fake
      process group and meta tensors stand in for it; ``mesh`` may be a shape (default: nodes x devices per
      node); the budget defaults to the device's memory; three of the repeated layers are captured and stand for
      all of them (``sample_layers=None`` in options... pass an int to change it).

    Options are :class:`PlanConfig` fields (``recipe="fsdp"`` makes the plan that manual recipe).

    Pipeline stages (offline path): ``pipeline="auto"`` also weighs splitting the layers into stages over
    sub-meshes and returns a plan with several ``stages`` when that is faster; a ``mesh`` given as
    ``{"pp": 4, "tp": 8}`` fixes 4 stages. The default ``"none"`` plans no stages.

    Gradient accumulation: ``microbatches=k`` plans the step as k micro-batches of the batch. Without it, a batch
    whose plan does not fit the memory budget is planned in 2, 4, 8, ... micro-batches: the fewest that fit and
    the next count, keeping the faster (``plan.microbatches``).
    """
    if isinstance(model, nn.Module):
        restore_meta(model)  # init_weights / load_pretrained on a meta model left stand-ins (weights/shards.py)
    return plan_only(
        model,
        mesh,
        example_inputs,
        cluster=cluster,
        memory_budget=memory_budget,
        constraints=constraints,
        seq=seq,
        global_batch=global_batch,
        progress=progress,
        pipeline=pipeline,
        microbatches=microbatches,
        options=options,
    )


def recipe(
    recipe: str,
    model: nn.Module | str | Any,
    mesh_or_cluster: DeviceMesh | str | ClusterProfile,
    example_inputs: Sequence[Any] | None = None,
    **kwargs: Any,
) -> Plan:
    """The manual recipe ``recipe`` (one of ``autoshard.config.RECIPES``: "ddp", "zero1", "zero2", "fsdp",
    "hsdp", "tp", "fsdp+tp", "ep", "cp"; aliases such as "megatron" or "zero3" in ``ALIASES``) as a Plan, costed
    exactly like a solved one (it can be compiled with ``autoshard.compile(..., recipe=recipe)``). ``mesh_or_cluster``
    is a DeviceMesh (then ``example_inputs`` are required, as for ``plan``) or a cluster spec (then ``kwargs`` as for
    ``plan``)."""
    if isinstance(mesh_or_cluster, DeviceMesh):
        return plan(model, mesh_or_cluster, example_inputs, recipe=recipe, solve_recipes=False, **kwargs)
    return plan(
        model,
        kwargs.pop("mesh", None),
        example_inputs,
        cluster=mesh_or_cluster,
        recipe=recipe,
        solve_recipes=False,
        **kwargs,
    )


def compile(  # noqa: A001 - the one-line API the project promises
    model: nn.Module,
    mesh: DeviceMesh,
    example_inputs: Sequence[Any] | Mapping[str, Any] | Call | None = None,
    *,
    cluster: str | ClusterProfile | None = None,
    memory_budget: int | str | None = None,
    constraints: Mapping[str, Any] | None = None,
    backend: str = "inductor",
    pipeline: str | None = None,
    microbatches: int | None = None,
    schedule: str | None = None,
    parameters: str = "auto",
    autotune: int | None = None,
    report: str | Path | None = None,
    trace: str | Path | None = None,
    **options: Any,
) -> ShardedModule | PipelinedModule | LazyShardedModule:
    """Plan, lower and compile ``model`` for this rank. Returns a trainable module: a ``ShardedModule``; a
    ``PipelinedModule`` when the mesh has a ``pp`` axis or ``pipeline="auto"`` chooses stages; a ``LazyShardedModule``
    (planned at its first call, from each rank's batch shard) when ``example_inputs`` is not given.

    Without ``example_inputs``, planning happens on the first call, from the inputs it sees, with data
    parallelism's convention: each rank passes its own shard of the batch (split on dim 0 over the mesh's
    data-parallel axes), and the loss and gradients are the global batch's (``runtime/lazy.py``).

    ``example_inputs`` are global-shaped. The returned module takes this rank's local input pieces
    (``sharded.shard_inputs(*global_tensors)``) and returns the loss, equal on every rank; or
    ``sharded.step(*global_tensors)`` runs forward and backward and returns the loss.

    Gradient accumulation (no ``pp`` axis): ``microbatches=k`` plans and compiles the program on one micro-batch
    (the batch, dim 0 of every batched input, cut into ``k``); ``sharded.step(*global)`` runs the ``k``
    micro-batches' forward and backward and returns the whole batch's loss and gradients (each micro-batch's loss
    weighted by the targets it counts: ``runtime/accumulate.py``); ``sharded(*pieces)`` runs one micro-batch.
    With a ``memory_budget`` the whole batch cannot meet and no ``microbatches``, 2, 4, 8, ... micro-batches are
    tried and the first that fits is taken (``plan.microbatches`` says how many).

    Pipeline stages: a mesh whose outermost axis is named ``"pp"`` runs that many stages, each on the sub-mesh
    of the other axes; ``pipeline="auto"`` weighs splitting the outermost axis into stages against no pipeline.
    ``microbatches`` and ``schedule`` ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble") are chosen unless
    given. A pipelined result is a :class:`PipelinedModule`: ``step(...)`` (the global batch, called as the model is)
    trains one step over all micro-batches; ``ShardedModule.step`` takes the same call, so one training loop serves
    both.

    ``parameters="dtensor"`` replaces each parameter by a DTensor parameter (optimizers built before are pointed
    at them on their next step); ``"local"`` keeps the parameter objects, each holding this rank's shard as a plain
    tensor (``state_dict()`` still gives DTensors); ``"auto"`` (default): "local" where the plan replicates every
    parameter and its state (DDP's plain tensors: no DTensor dispatch in the optimizer step), else "dtensor".

    ``plan=Plan.from_json(text)`` runs a saved single-stage plan without solving: it must have been made for this
    program (``plan.fingerprint``: ops, parameters, input shapes, mesh, cluster, precision, versions), or it is
    refused naming what differs (``autoshard/compiler/solve_reuse.py``). ``autotune=k``: the solver's k best distinct
    plans and the recipes that fit are timed on the mesh and the fastest kept, cached on disk
    (``autoshard/search/autotune.py``).

    ``batch_axes`` (without ``example_inputs``): the mesh axes whose ranks pass different rows, the others
    passing the same ones: None (default) for the data-parallel axes (DDP's convention), ``"all"`` when every
    process passes its own rows (a loader sharded over all processes). Under an Accelerator or a Hugging Face
    Trainer it is ``"all"`` (their loaders shard over all processes: ``autoshard/integrations/``).

    ``report="plan.html"`` writes the plan's page (``autoshard/plans/html/page.py``) from rank 0 once it is planned
    (without ``example_inputs``: at the first call); ``trace="plan.json.gz"`` its predicted step in the Chrome trace
    event format Perfetto opens (``autoshard/plans/trace.py``), beside which ``sharded.profile(...)`` writes the
    measured one.
    """
    install_loaded()  # the loops this process imported (the Hugging Face Trainer) checkpoint it by rank
    if parameters != "local":  # (the local path keeps the objects dynamo traced: it shards the stand-ins in place)
        restore_meta(model)  # init_weights / load_pretrained on a meta model left stand-ins (weights/shards.py)
    if example_inputs is None:
        return compile_lazily(
            model,
            mesh,
            constraints,
            dict(
                cluster=cluster,
                memory_budget=memory_budget,
                backend=backend,
                pipeline=pipeline,
                microbatches=microbatches,
                schedule=schedule,
                parameters=parameters,
                report=report,
                trace=trace,
                **options,
            ),
        )
    return compile_and_report(
        model,
        mesh,
        example_inputs,
        report,
        cluster=cluster,
        memory_budget=memory_budget,
        constraints=constraints,
        backend=backend,
        pipeline=pipeline,
        microbatches=microbatches,
        schedule=schedule,
        parameters=parameters,
        autotune=autotune,
        trace=trace,
        **options,
    )
