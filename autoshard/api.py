"""The public entry points: ``autoshard.plan`` and ``autoshard.compile``."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autoshard import _torch_compat as tc
from autoshard.cluster.presets import get_cluster
from autoshard.cluster.profile import ClusterProfile
from autoshard.compiler.context import BACKENDS
from autoshard.compiler.runner import check_disabled, rank_program
from autoshard.config import PlanConfig
from autoshard.errors import InputError
from autoshard.inputs import Call, example_call
from autoshard.integrations import install_loaded, loop_defaults
from autoshard.plans.html.page import write_html
from autoshard.plans.plan import Plan
from autoshard.runtime.evaluate import PlanEval
from autoshard.runtime.lazy import LazyShardedModule
from autoshard.runtime.pipelined import PipelinedModule
from autoshard.runtime.shapes import PlanShapes
from autoshard.runtime.sharded_module import ShardedModule
from autoshard.search.recipes_alone import plan_flat
from autoshard.search.autotune import autotune as _autotune
from autoshard.search.recompute import plan_graph
from autoshard.weights.shards import restore_meta

log = logging.getLogger(__name__)


def _config(memory_budget: Any, constraints: Mapping | None, **kw: Any) -> PlanConfig:
    saved = kw.pop("plan", None)
    if saved is not None:  # compile(..., plan=saved): its choices and program options, no solve, no budget
        kw.setdefault("recompute", saved.recompute_layers)
        kw.setdefault("mixed_precision", saved.mixed_precision or None)
        kw.setdefault("reduce_dtype", saved.reduce_dtype or "float32")
        kw.setdefault("precision_policy", saved.precision_policy or "autocast")  # (plans saved before the policy)
        kw.update(reuse=saved, solve_recipes=False)
        memory_budget = None
    return PlanConfig(memory_budget=memory_budget, constraints=dict(constraints or {}), **kw)


def _check_compilable(model: nn.Module, mesh: DeviceMesh, real_group: bool) -> None:
    """What compile needs that plan does not: a mesh over every rank. (Parameters on the meta device get this
    rank's shards only; their values come from ``init_weights`` or a checkpoint: ``autoshard/weights/``.)"""
    if real_group and mesh.size() != dist.get_world_size():
        raise InputError(
            f"the mesh {dict(zip(mesh.mesh_dim_names or range(mesh.ndim), mesh.shape))} holds {mesh.size()} ranks but "
            f"the process group has {dist.get_world_size()}; autoshard.compile shards over every rank: make the mesh "
            "with init_device_mesh over the whole world (its shape's product = the world size)"
        )


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
    if isinstance(mesh, DeviceMesh) and isinstance(model, nn.Module) and global_batch is None:
        if pipeline != "none":
            raise InputError("pipeline planning runs on the offline path: call autoshard.plan(model, "
                             "example_inputs=..., cluster=...) without a DeviceMesh (or compile with pipeline=)")
        if "sample_layers" not in options:  # planning only: compile captures every layer (it runs them)
            from autoshard.ir import repeated_layers
            from autoshard.offline import DEFAULT_SAMPLE_LAYERS

            found = repeated_layers(model)
            long = found is not None and found[1] >= 2 * DEFAULT_SAMPLE_LAYERS
            options["sample_layers"] = DEFAULT_SAMPLE_LAYERS if long else None
        planned, _ = plan_flat(model, example_call(example_inputs), mesh, get_cluster(cluster),
                                      _config(memory_budget, constraints, **options), False, microbatches,
                                      weigh_next=True, progress=progress)
        return dataclasses.replace(planned.plan, model=type(model).__name__)
    from autoshard.offline import plan_offline

    if cluster is None:
        raise InputError(
            "autoshard.plan without a DeviceMesh needs cluster= (a preset such as 'h100-sxm:16x8', see "
            "autoshard.cluster.presets.known_clusters(), or a .json profile)"
        )
    return plan_offline(
        model,
        cluster=cluster,
        mesh=mesh,
        example_inputs=example_inputs,
        seq=seq,
        global_batch=global_batch,
        memory_budget=memory_budget,
        config=_config(None, constraints, **options),
        progress=progress,
        pipeline=pipeline,
        microbatches=microbatches,
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
    exactly like a solved one (it can be compiled with ``autoshard.compile(..., recipe=recipe)``). ``mesh_or_cluster`` is a DeviceMesh
    (then ``example_inputs`` are required, as for ``plan``) or a cluster spec (then ``kwargs`` as for ``plan``)."""
    if isinstance(mesh_or_cluster, DeviceMesh):
        return plan(model, mesh_or_cluster, example_inputs, recipe=recipe, solve_recipes=False, **kwargs)
    return plan(model, kwargs.pop("mesh", None), example_inputs, cluster=mesh_or_cluster, recipe=recipe,
                solve_recipes=False, **kwargs)


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
    given. A pipelined result is a :class:`PipelinedModule`: ``step(...)`` (the global batch, called as the model is) trains one step
    over all micro-batches; ``ShardedModule.step`` takes the same call, so one training loop serves both.

    ``parameters="dtensor"`` replaces each parameter by a DTensor parameter (optimizers built before are pointed
    at them on their next step); ``"local"`` keeps the parameter objects, each holding this rank's shard as a plain
    tensor (``state_dict()`` still gives DTensors); ``"auto"`` (default): "local" where the plan replicates every
    parameter and its state (DDP's plain tensors: no DTensor dispatch in the optimizer step), else "dtensor".

    ``plan=Plan.from_json(text)`` runs a saved single-stage plan without solving: it must have been made for this
    program (``plan.fingerprint``: ops, parameters, input shapes, mesh, cluster, precision, versions), or it is
    refused naming what differs (``autoshard/compiler/solve_reuse.py``). ``autotune=k``: the solver's k best distinct plans and
    the recipes that fit are timed on the mesh and the fastest kept, cached on disk (``autoshard/search/autotune.py``).

    ``batch_axes`` (without ``example_inputs``): the mesh axes whose ranks pass different rows, the others
    passing the same ones: None (default) for the data-parallel axes (DDP's convention), ``"all"`` when every
    process passes its own rows (a loader sharded over all processes). Under an Accelerator or a Hugging Face
    Trainer it is ``"all"`` (their loaders shard over all processes: ``autoshard/integrations/``).

    ``report="plan.html"`` writes the plan's page (``autoshard/plans/html/page.py``) from rank 0 once it is planned
    (without ``example_inputs``: at the first call).
    """
    install_loaded()  # the loops this process imported (the Hugging Face Trainer) checkpoint it by rank
    if parameters != "local":  # (the local path keeps the objects dynamo traced: it shards the stand-ins in place)
        restore_meta(model)  # init_weights / load_pretrained on a meta model left stand-ins (weights/shards.py)
    if report is not None and example_inputs is not None:
        out = compile(model, mesh, example_inputs, cluster=cluster, memory_budget=memory_budget,
                      constraints=constraints, backend=backend, pipeline=pipeline, microbatches=microbatches,
                      schedule=schedule, parameters=parameters, autotune=autotune, **options)
        if not dist.is_initialized() or dist.get_rank() == 0 or tc.in_local_tensor_mode():
            write_html(out.plan, report)
        return out
    if backend not in BACKENDS:
        raise InputError(f"backend={backend!r} is not known; use one of {BACKENDS}")
    check_disabled(tuple(options.get("disable_passes", ())))
    if parameters not in ("auto", "dtensor", "local"):
        raise InputError(f"parameters={parameters!r}: use 'auto', 'dtensor' or 'local' (see compile's docstring)")
    if parameters == "local":  # each parameter object holds its compute shard, which the optimizer steps
        options.setdefault("shard_state", False)
    if options.get("plan") is not None and options["plan"].microbatches > 1:
        microbatches = microbatches or options["plan"].microbatches
    if example_inputs is not None and "batch_axes" in options:
        raise InputError("batch_axes= says how each rank's rows make the global batch when compile is called without "
                         "example_inputs; with global example_inputs the plan places the inputs itself")
    if example_inputs is None:
        if microbatches is not None and "pp" not in tuple(mesh.mesh_dim_names or ()) and pipeline != "auto":
            raise InputError(
                f"microbatches={microbatches} without pipeline stages is gradient accumulation over the global "
                "batch: pass global-shaped example_inputs to compile and train with sharded.step(global batch) "
                "(compile without example_inputs takes each rank's batch shard in forward, one call per micro-batch)"
            )
        return _compile_on_first_call(model, mesh, constraints, dict(
            cluster=cluster, memory_budget=memory_budget, backend=backend, pipeline=pipeline,
            microbatches=microbatches, schedule=schedule, parameters=parameters, report=report, **options))
    if pipeline not in (None, "auto", "none"):
        raise InputError(f"pipeline={pipeline!r} is not known; use None/'none' (a 'pp' mesh axis decides) or 'auto'")
    inputs = example_call(example_inputs)
    # DTensor's sharding caches may hold meshes of another world (a plan made on a fake group, LocalTensorMode,
    # or a parent process this one was forked from): start from a clean cache
    tc.clear_dtensor_caches()
    real_group = dist.is_initialized() and dist.get_world_size() > 1 and not tc.in_local_tensor_mode()
    _check_compilable(model, mesh, real_group)
    config = _config(memory_budget, constraints, **options)
    names = tuple(mesh.mesh_dim_names or ())
    if "pp" in names or pipeline == "auto":
        piped = _compile_pipelined(model, mesh, inputs, get_cluster(cluster), config, backend, pipeline,
                                   microbatches, schedule, real_group)
        if piped is not None:
            return piped
    if autotune:
        return _autotune(model, inputs, int(autotune), backend, real_group, lambda: plan_graph(
            model, inputs, mesh, get_cluster(cluster), config, real_group), lambda m, saved: compile(
            m, mesh, example_inputs, cluster=cluster, backend=backend, parameters=parameters, plan=saved,
            random=config.random))
    planned, accumulation = plan_flat(model, inputs, mesh, get_cluster(cluster), config, real_group,
                                             microbatches)
    p, ctx = planned.plan, planned.ctx
    program = rank_program(planned.graph, ctx, backend)
    grad_names = [r.name for r in ctx.output_roles if r.kind == "grad"]
    sharded = ShardedModule(model, mesh, p, program, grad_names, ctx.signature, parameters, accumulation,
                            plan_eval=_eval_planner(mesh, get_cluster(cluster), config, backend, real_group),
                            plan_shapes=_shape_planner(p, mesh, get_cluster(cluster), config, backend, real_group))
    sharded.timings = dict(ctx.timings)
    if ctx.loss_form is not None:
        sharded.loss_form = ctx.loss_form
    return sharded


def _eval_planner(mesh: DeviceMesh, cluster: ClusterProfile, config: PlanConfig, backend: str,
                  real_group: bool) -> PlanEval:
    """How a compiled module plans its evaluation programs (``runtime/evaluate.py``): the forward with every
    output kept, under the training plan's options, with the given constraints (parameters pinned to their
    compute layouts), no recipes, no budget and no recomputation (nothing is saved for a backward)."""

    def plan_eval(model: nn.Module, example: Call, constraints: Mapping[str, Any]) -> tuple[Plan, Any]:
        cfg = dataclasses.replace(config, constraints=dict(constraints), solve_recipes=False, recipe=None,
                                  memory_budget=None, recompute=(), shard_state=False, reuse=None, offload="none")
        planned = plan_graph(model, example, mesh, cluster, cfg, broadcast_solution=real_group, stage=True)
        return planned.plan, rank_program(planned.graph, planned.ctx, backend)

    return plan_eval


def _shape_planner(first: Plan, mesh: DeviceMesh, cluster: ClusterProfile, config: PlanConfig, backend: str,
                   real_group: bool) -> PlanShapes:
    """How a compiled module plans a call of other input shapes (``ShardedModule._switch_shapes``): the first
    plan's choices replayed on the new program (``compiler/solve_reuse.py``; no solve), or, where one of them does
    not hold at these shapes (an axis that no longer divides a dimension), a solve with the parameters and inputs
    pinned to their layouts. No recipes are compared and no budget is re-searched: the module keeps its layouts."""
    base = dataclasses.replace(config, solve_recipes=False, memory_budget=None, recipe=None,
                               recompute=tuple(first.recompute_layers) or config.recompute)

    def plan_shapes(model: nn.Module, example: Call, pins: Mapping[str, Any]) -> tuple[Plan, Any, str]:
        try:
            cfg = dataclasses.replace(base, reuse=dataclasses.replace(first, fingerprint=()))
            planned, how = plan_graph(model, example, mesh, cluster, cfg, broadcast_solution=real_group), "layouts reused"
        except InputError as e:
            log.info("compile: the first plan's layouts do not all hold at the new shapes (%s); solving with the "
                     "parameters and inputs pinned", e)
            cfg = dataclasses.replace(base, reuse=None, constraints={**config.constraints, **pins})
            planned, how = plan_graph(model, example, mesh, cluster, cfg, broadcast_solution=real_group), "re-solved"
        program = rank_program(planned.graph, planned.ctx, backend)
        spent = sorted(planned.ctx.timings.items(), key=lambda kv: -kv[1])[:4]
        return planned.plan, program, how + ": " + ", ".join(f"{k} {v:.1f} s" for k, v in spent)

    return plan_shapes


def _compile_on_first_call(model: nn.Module, mesh: DeviceMesh, constraints: Mapping[str, Any] | None,
                           options: dict[str, Any]) -> LazyShardedModule:
    """``compile`` without example inputs: DDP's input convention, planned when first called (runtime/lazy.py)."""
    user = dict(constraints or {})
    if any(k == "inputs" or k.startswith("input[") for k in user):
        raise InputError(
            "compile without example_inputs splits every input over the data-parallel ranks (each rank passes its "
            "batch shard); to place inputs otherwise, pass global-shaped example_inputs with your input constraints"
        )
    batch_axes = options.pop("batch_axes", None)
    if "pp" in tuple(mesh.mesh_dim_names or ()) or options.get("pipeline") == "auto":
        # pipelines take the global batch on every rank (step): nothing to pin
        return LazyShardedModule(model, mesh, lambda example, pins: compile(
            model, mesh, example, constraints=user, **options), pipelined=True, options=options)
    return LazyShardedModule(model, mesh, lambda example, pins: compile(
        model, mesh, example, constraints={**pins, **user}, **options), options=options, batch_axes=batch_axes,
        before_plan=loop_defaults)


def _compile_pipelined(
    model: nn.Module,
    mesh: DeviceMesh,
    inputs: tuple | dict | Call,
    cluster: ClusterProfile,
    config: PlanConfig,
    backend: str,
    pipeline: str | None,
    microbatches: int | None,
    schedule: str | None,
    real_group: bool,
) -> PipelinedModule | None:
    """The pipelined program, or None when ``pipeline="auto"`` finds no pipeline faster than the plain plan."""
    from autoshard.pipeline.compile_stages import choose_pipeline, compile_pipelined

    names = tuple(mesh.mesh_dim_names or ())
    if not real_group or tc.in_local_tensor_mode():
        raise InputError("pipeline stages run on a real process group (torchrun or gloo workers), one process per "
                         "rank; LocalTensorMode and single-process meshes cannot run a pipeline schedule")
    if "pp" in names and names[0] != "pp":
        raise InputError(f"the 'pp' axis must be the outermost mesh axis; mesh axes are {names}")
    counts = [mesh.shape[0]] if "pp" in names else [s for s in range(2, mesh.shape[0] + 1) if mesh.shape[0] % s == 0]
    choice = choose_pipeline(model, inputs, mesh, cluster, config, counts, microbatches, schedule)
    if choice is None:
        if "pp" in names:
            raise InputError(f"no split of the model into {counts[0]} pipeline stages fits; see the log for each "
                             "micro-batch count tried")
        return None
    if "pp" not in names:
        plain = plan_graph(model, inputs, mesh, cluster, config, broadcast_solution=True).plan
        if plain.step_time_s <= choice.split.step_time_s:
            log.info("compile: no pipeline (%.6f s per step) beats %d stages (%.6f s)", plain.step_time_s,
                     choice.stages, choice.split.step_time_s)
            return None
    log.info("compile: %d pipeline stages, %d micro-batches, %s", choice.stages, choice.split.microbatches,
             choice.split.schedule)
    return compile_pipelined(model, mesh, inputs, cluster, config, backend, choice)
