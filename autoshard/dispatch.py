"""One request, one dispatcher: how every call that plans reaches its plan or its running program.

``autoshard.compile``, ``autoshard.plan``, the CLI (through ``plan``), the module compiled at its first call
(``runtime/lazy.py``), a compiled module's programs for new input shapes (``runtime/shapes.py``) and for
evaluation (``runtime/evaluate.py``), and autotune's candidates all come here; none of them calls ``compile``
again. The order, one for every caller:

1. **the request** (``request_of``): the call's arguments checked once and made one frozen :class:`PlanRequest`
   (model, global example call, mesh, cluster, :class:`~autoshard.config.PlanConfig`, backend, options);
2. **where it is planned** (``plan_only``, for ``plan``): on a cluster this process is not part of (``offline.py``
   resolves the request: a fake world, meta tensors; the stage search, ``pipeline/plan_offline.py``, runs where a
   ``pp`` axis or ``pipeline="auto"`` asks), or on the given DeviceMesh;
3. **pipeline stages** (``compile_request``): a ``pp`` mesh axis, or ``pipeline="auto"`` weighing stages against
   the flat plan (``pipeline/compile_stages.py``);
4. **autotune** (``autotune=k``): the solver's k best plans and the recipes timed (``search/autotune.py``), each
   candidate compiled by ``compile_saved``;
5. **the flat plan**: every recipe planned alone, then gradient accumulation, then recomputation
   (``search/recipes_alone.py`` -> ``search/accumulate.py`` -> ``search/recompute.py``), lowered and compiled for
   this rank (``compiler/runner.py``);
6. **the runtime's module**, handed the dispatcher's named re-planners: ``plan_for_shapes`` and
   ``plan_for_eval``, bound to the request.

Without example inputs, ``compile_lazily`` returns the module that runs 1-6 at its first call
(``compile_for_call``), from the inputs it sees. (This module sits beside ``api.py``, not in ``search/``: it
chooses between the searches and the pipeline stages, and ``pipeline/`` plans its stages with ``search/``.)
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Mapping
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
from autoshard.ir import repeated_layers
from autoshard.offline import DEFAULT_SAMPLE_LAYERS, offline_request, plan_flat_offline, with_model_figures
from autoshard.pipeline.plan_offline import plan_with_pipeline
from autoshard.plans.html.page import write_html
from autoshard.plans.plan import Plan
from autoshard.plans.trace import predicted_trace, write_trace
from autoshard.runtime.lazy import LazyShardedModule
from autoshard.runtime.pipelined import PipelinedModule
from autoshard.runtime.program import Program, StageProgram
from autoshard.runtime.sharded_module import ShardedModule
from autoshard.search.autotune import autotune
from autoshard.search.floor import refuse_below_floor
from autoshard.search.recipes_alone import plan_flat
from autoshard.search.recompute import plan_graph
from autoshard.weights.shards import restore_meta

log = logging.getLogger(__name__)

PARAMETER_MODES = ("auto", "dtensor", "local")
PIPELINE_CHOICES = (None, "auto", "none")


@dataclasses.dataclass(frozen=True, eq=False)
class PlanRequest:
    """One call's planning request: what is planned (``model`` on the global ``inputs``), where (``mesh``,
    priced on ``cluster``), under which options (``config``), and how the program runs (``backend``,
    ``parameters``); ``real_group``: the ranks of a real process group plan together (rank 0's solution)."""

    model: nn.Module
    inputs: Call
    mesh: DeviceMesh
    cluster: ClusterProfile
    config: PlanConfig
    real_group: bool
    backend: str = "inductor"
    pipeline: str | None = None
    microbatches: int | None = None
    schedule: str | None = None
    parameters: str = "auto"
    autotune: int | None = None


def plan_config(memory_budget: Any, constraints: Mapping | None, **kw: Any) -> PlanConfig:
    """The :class:`PlanConfig` of a call's options; ``plan=saved`` replays a saved plan's choices and program
    options (no solve, no budget)."""
    saved = kw.pop("plan", None)
    if saved is not None:
        kw.setdefault("recompute", saved.recompute_layers)
        kw.setdefault("mixed_precision", saved.mixed_precision or None)
        kw.setdefault("reduce_dtype", saved.reduce_dtype or "float32")
        kw.setdefault("precision_policy", saved.precision_policy or "autocast")  # (plans saved before the policy)
        kw.update(reuse=saved, solve_recipes=False)
        memory_budget = None
    return PlanConfig(memory_budget=memory_budget, constraints=dict(constraints or {}), **kw)


def request_of(
    model: nn.Module,
    mesh: DeviceMesh,
    example_inputs: Any,
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
    **options: Any,
) -> PlanRequest:
    """``compile``'s arguments (global-shaped ``example_inputs``) checked and made one request."""
    microbatches = check_options(backend, parameters, microbatches, options)
    if "batch_axes" in options:
        raise InputError(
            "batch_axes= says how each rank's rows make the global batch when compile is called without "
            "example_inputs; with global example_inputs the plan places the inputs itself"
        )
    if pipeline not in PIPELINE_CHOICES:
        raise InputError(f"pipeline={pipeline!r} is not known; use None/'none' (a 'pp' mesh axis decides) or 'auto'")
    inputs = example_call(example_inputs)
    # DTensor's sharding caches may hold meshes of another world (a plan made on a fake group, LocalTensorMode,
    # or a parent process this one was forked from): start from a clean cache
    tc.clear_dtensor_caches()
    real_group = dist.is_initialized() and dist.get_world_size() > 1 and not tc.in_local_tensor_mode()
    _check_compilable(mesh, real_group)
    prof, config = get_cluster(cluster), plan_config(memory_budget, constraints, **options)
    refuse_below_floor(model, config, prof, mesh.size())  # (in a moment, before any capture)
    args = (real_group, backend, pipeline, microbatches, schedule, parameters, autotune)
    return PlanRequest(model, inputs, mesh, prof, config, *args)


def check_options(backend: str, parameters: str, microbatches: int | None, options: dict[str, Any]) -> int | None:
    """The checks of ``compile``'s options made when it is called, also when it plans later (no example inputs):
    ``options`` completed in place (``parameters="local"`` keeps the optimizer state whole); returns the
    micro-batch count (a saved plan's, ``plan=``, unless given)."""
    if backend not in BACKENDS:
        raise InputError(f"backend={backend!r} is not known; use one of {BACKENDS}")
    check_disabled(tuple(options.get("disable_passes", ())))
    if parameters not in PARAMETER_MODES:
        raise InputError(f"parameters={parameters!r}: use 'auto', 'dtensor' or 'local' (see compile's docstring)")
    if parameters == "local":  # each parameter object holds its compute shard, which the optimizer steps
        options.setdefault("shard_state", False)
    if options.get("plan") is not None and options["plan"].microbatches > 1:
        microbatches = microbatches or options["plan"].microbatches
    return microbatches


def _check_compilable(mesh: DeviceMesh, real_group: bool) -> None:
    """What compile needs that plan does not: a mesh over every rank. (Parameters on the meta device get this
    rank's shards only; their values come from ``init_weights`` or a checkpoint: ``autoshard/weights/``.)"""
    if real_group and mesh.size() != dist.get_world_size():
        raise InputError(
            f"the mesh {dict(zip(mesh.mesh_dim_names or range(mesh.ndim), mesh.shape))} holds {mesh.size()} ranks but "
            f"the process group has {dist.get_world_size()}; autoshard.compile shards over every rank: make the mesh "
            "with init_device_mesh over the whole world (its shape's product = the world size)"
        )


def compile_request(req: PlanRequest) -> ShardedModule | PipelinedModule:
    """The request's trainable module: pipeline stages where the mesh or the search asks for them, else the
    autotuned or the flat plan's program (steps 3-6 of the module docstring)."""
    names = tuple(req.mesh.mesh_dim_names or ())
    if "pp" in names or req.pipeline == "auto":
        piped = _compile_pipelined(req)
        if piped is not None:
            return piped
    if req.autotune:
        return autotune(
            req.model,
            req.inputs,
            int(req.autotune),
            req.backend,
            req.real_group,
            functools.partial(_plan_graph, req),
            functools.partial(compile_saved, req),
        )
    planned, accumulation = plan_flat(
        req.model, req.inputs, req.mesh, req.cluster, req.config, req.real_group, req.microbatches
    )
    p, ctx = planned.plan, planned.ctx
    program = rank_program(planned.graph, ctx, req.backend)
    grad_names = [r.name for r in ctx.output_roles if r.kind == "grad"]
    sharded = ShardedModule(
        req.model,
        req.mesh,
        p,
        program,
        grad_names,
        ctx.signature,
        req.parameters,
        accumulation,
        plan_eval=functools.partial(plan_for_eval, req),
        plan_shapes=functools.partial(plan_for_shapes, req, p),
    )
    sharded.timings = dict(ctx.timings)
    if ctx.loss_form is not None:
        sharded.loss_form = ctx.loss_form
    return sharded


def _plan_graph(req: PlanRequest) -> Any:
    return plan_graph(req.model, req.inputs, req.mesh, req.cluster, req.config, req.real_group)


def compile_saved(req: PlanRequest, model: nn.Module, saved: Plan) -> ShardedModule | PipelinedModule:
    """``saved``'s choices compiled on ``model`` (autotune's candidates): the request's program without a solve."""
    config = plan_config(None, None, plan=saved, random=req.config.random)
    tc.clear_dtensor_caches()
    return compile_request(
        dataclasses.replace(
            req,
            model=model,
            config=config,
            autotune=None,
            pipeline=None,
            microbatches=saved.microbatches if saved.microbatches > 1 else None,
        )
    )


def plan_for_eval(
    req: PlanRequest, model: nn.Module, example: Call, constraints: Mapping[str, Any]
) -> tuple[Plan, StageProgram]:
    """A compiled module's evaluation program (``runtime/evaluate.py``): the forward with every output kept,
    under the training plan's options, with the given constraints (parameters pinned to their compute layouts),
    no recipes, no budget and no recomputation (nothing is saved for a backward)."""
    cfg = dataclasses.replace(
        req.config,
        constraints=dict(constraints),
        solve_recipes=False,
        recipe=None,
        memory_budget=None,
        recompute=(),
        shard_state=False,
        reuse=None,
        offload="none",
    )
    planned = plan_graph(model, example, req.mesh, req.cluster, cfg, broadcast_solution=req.real_group, stage=True)
    return planned.plan, rank_program(planned.graph, planned.ctx, req.backend)


def plan_for_shapes(
    req: PlanRequest, first: Plan, model: nn.Module, example: Call, pins: Mapping[str, Any]
) -> tuple[Plan, Program, str]:
    """A compiled module's program for a call of other input shapes (``ShardedModule._switch_shapes``): the first
    plan's choices replayed on the new program (``compiler/solve_reuse.py``; no solve), or, where one of them does
    not hold at these shapes (an axis that no longer divides a dimension), a solve with the parameters and inputs
    pinned to their layouts. No recipes are compared and no budget is re-searched: the module keeps its layouts."""
    config = req.config
    base = dataclasses.replace(
        config,
        solve_recipes=False,
        memory_budget=None,
        recipe=None,
        recompute=tuple(first.recompute_layers) or config.recompute,
    )
    try:
        cfg = dataclasses.replace(base, reuse=dataclasses.replace(first, fingerprint=()))
        planned, how = (
            plan_graph(model, example, req.mesh, req.cluster, cfg, broadcast_solution=req.real_group),
            "layouts reused",
        )
    except InputError as e:
        log.info(
            "compile: the first plan's layouts do not all hold at the new shapes (%s); solving with the "
            "parameters and inputs pinned",
            e,
        )
        cfg = dataclasses.replace(base, reuse=None, constraints={**config.constraints, **pins})
        planned, how = (
            plan_graph(model, example, req.mesh, req.cluster, cfg, broadcast_solution=req.real_group),
            "re-solved",
        )
    program = rank_program(planned.graph, planned.ctx, req.backend)
    spent = sorted(planned.ctx.timings.items(), key=lambda kv: -kv[1])[:4]
    return planned.plan, program, how + ": " + ", ".join(f"{k} {v:.1f} s" for k, v in spent)


def _compile_pipelined(req: PlanRequest) -> PipelinedModule | None:
    """The pipelined program, or None when ``pipeline="auto"`` finds no pipeline faster than the plain plan."""
    from autoshard.pipeline.compile_stages import choose_pipeline, compile_pipelined

    mesh = req.mesh
    names = tuple(mesh.mesh_dim_names or ())
    if not req.real_group or tc.in_local_tensor_mode():
        raise InputError(
            "pipeline stages run on a real process group (torchrun or gloo workers), one process per "
            "rank; LocalTensorMode and single-process meshes cannot run a pipeline schedule"
        )
    if "pp" in names and names[0] != "pp":
        raise InputError(f"the 'pp' axis must be the outermost mesh axis; mesh axes are {names}")
    counts = [mesh.shape[0]] if "pp" in names else [s for s in range(2, mesh.shape[0] + 1) if mesh.shape[0] % s == 0]
    choice = choose_pipeline(
        req.model, req.inputs, mesh, req.cluster, req.config, counts, req.microbatches, req.schedule
    )
    if choice is None:
        if "pp" in names:
            raise InputError(
                f"no split of the model into {counts[0]} pipeline stages fits; see the log for each "
                "micro-batch count tried"
            )
        return None
    if "pp" not in names:
        plain = plan_graph(req.model, req.inputs, mesh, req.cluster, req.config, broadcast_solution=True).plan
        if plain.step_time_s <= choice.split.step_time_s:
            log.info(
                "compile: no pipeline (%.6f s per step) beats %d stages (%.6f s)",
                plain.step_time_s,
                choice.stages,
                choice.split.step_time_s,
            )
            return None
    log.info(
        "compile: %d pipeline stages, %d micro-batches, %s",
        choice.stages,
        choice.split.microbatches,
        choice.split.schedule,
    )
    return compile_pipelined(req.model, mesh, req.inputs, req.cluster, req.config, req.backend, choice)


def compile_and_report(
    model: nn.Module, mesh: DeviceMesh, example_inputs: Any, report: str | Path | None, **kwargs: Any
) -> ShardedModule | PipelinedModule:
    """``compile``'s global-shaped path: the request's module, its page (``report``) and its predicted trace
    (``trace``) written from rank 0."""
    trace = kwargs.pop("trace", None)
    out = compile_request(request_of(model, mesh, example_inputs, **kwargs))
    if not dist.is_initialized() or dist.get_rank() == 0 or tc.in_local_tensor_mode():
        if report is not None:
            write_html(out.plan, report)
        if trace is not None:
            write_trace(predicted_trace(out.plan), trace)
    return out


def compile_lazily(
    model: nn.Module, mesh: DeviceMesh, constraints: Mapping[str, Any] | None, options: dict[str, Any]
) -> LazyShardedModule:
    """``compile`` without example inputs: DDP's input convention, planned when first called (runtime/lazy.py)."""
    user = dict(constraints or {})
    options["microbatches"] = check_options(
        options.get("backend", "inductor"), options.get("parameters", "auto"), options.get("microbatches"), options
    )
    if any(k == "inputs" or k.startswith("input[") for k in user):
        raise InputError(
            "compile without example_inputs splits every input over the data-parallel ranks (each rank passes its "
            "batch shard); to place inputs otherwise, pass global-shaped example_inputs with your input constraints"
        )
    if (
        options.get("microbatches") is not None
        and "pp" not in tuple(mesh.mesh_dim_names or ())
        and options.get("pipeline") != "auto"
    ):
        raise InputError(
            f"microbatches={options['microbatches']} without pipeline stages is gradient accumulation over the global "
            "batch: pass global-shaped example_inputs to compile and train with sharded.step(global batch) "
            "(compile without example_inputs takes each rank's batch shard in forward, one call per micro-batch)"
        )
    batch_axes = options.pop("batch_axes", None)
    # (the options are read when the module is first called: an integration may still set one the user left)
    if "pp" in tuple(mesh.mesh_dim_names or ()) or options.get("pipeline") == "auto":
        # pipelines take the global batch on every rank (step): nothing to pin
        return LazyShardedModule(
            model,
            mesh,
            functools.partial(compile_for_call, model, mesh, user, options, False),
            pipelined=True,
            options=options,
        )
    return LazyShardedModule(
        model,
        mesh,
        functools.partial(compile_for_call, model, mesh, user, options, True),
        options=options,
        batch_axes=batch_axes,
        before_plan=loop_defaults,
    )


def compile_for_call(
    model: nn.Module,
    mesh: DeviceMesh,
    user: Mapping[str, Any],
    options: Mapping[str, Any],
    pin: bool,
    example: Call,
    pins: dict[str, Any],
) -> ShardedModule | PipelinedModule:
    """The lazy module's first call: the request of the global ``example`` its ranks' shards make, with the input
    ``pins`` that say how they are split (``pin``: flat programs; pipelines take the global batch)."""
    kw = dict(options)
    report = kw.pop("report", None)
    install_loaded()  # (as compile does: the loops imported since, and weights loaded into a meta model since)
    if kw.get("parameters", "auto") != "local":
        restore_meta(model)
    constraints = {**pins, **user} if pin else dict(user)
    return compile_and_report(model, mesh, example, report, constraints=constraints, **kw)


def plan_only(
    model: nn.Module | str | Any,
    mesh: DeviceMesh | Any,
    example_inputs: Any,
    *,
    cluster: str | ClusterProfile | None,
    memory_budget: int | str | None,
    constraints: Mapping[str, Any] | None,
    seq: int | None,
    global_batch: int | None,
    progress: Any,
    pipeline: str,
    microbatches: int | None,
    options: dict[str, Any],
) -> Plan:
    """``autoshard.plan``: on a DeviceMesh of this process's (possibly fake) group, the flat plan, three of a long
    stack of identical layers captured unless ``sample_layers`` says otherwise, the micro-batch counts weighed;
    else for a cluster this process is not part of (``offline.py``, which weighs pipeline stages)."""
    if isinstance(mesh, DeviceMesh) and isinstance(model, nn.Module) and global_batch is None:
        if pipeline != "none":
            raise InputError(
                "pipeline planning runs on the offline path: call autoshard.plan(model, "
                "example_inputs=..., cluster=...) without a DeviceMesh (or compile with pipeline=)"
            )
        if "sample_layers" not in options:  # planning only: compile captures every layer (it runs them)
            found = repeated_layers(model)
            long = found is not None and found[1] >= 2 * DEFAULT_SAMPLE_LAYERS
            options["sample_layers"] = DEFAULT_SAMPLE_LAYERS if long else None
        prof, config = get_cluster(cluster), plan_config(memory_budget, constraints, **options)
        refuse_below_floor(model, config, prof, mesh.size())
        call = example_call(example_inputs)
        planned, _ = plan_flat(model, call, mesh, prof, config, False, microbatches, weigh_next=True, progress=progress)
        return dataclasses.replace(planned.plan, model=type(model).__name__)
    if cluster is None:
        raise InputError(
            "autoshard.plan without a DeviceMesh needs cluster= (a preset such as 'h100-sxm:16x8', see "
            "autoshard.cluster.presets.known_clusters(), or a .json profile)"
        )
    req = offline_request(
        model,
        cluster=cluster,
        mesh=mesh,
        example_inputs=example_inputs,
        seq=seq,
        global_batch=global_batch,
        memory_budget=memory_budget,
        config=plan_config(None, constraints, **options),
        progress=progress,
        pipeline=pipeline,
        microbatches=microbatches,
    )
    if not req.pipelined:
        return with_model_figures(req, plan_flat_offline(req))
    fixed = {"sub_shape": req.shape, "axis_names": req.names} if req.stages else {}  # (a pp axis: its sub-mesh)
    flat = functools.partial(plan_flat_offline, req)
    plan = plan_with_pipeline(
        req.job.module, req.job.inputs, req.prof, req.cfg, flat, stages=req.stages, progress=req.progress, **fixed
    )
    return with_model_figures(req, plan)


__all__ = [
    "PlanRequest",
    "compile_and_report",
    "compile_for_call",
    "compile_lazily",
    "compile_request",
    "compile_saved",
    "check_options",
    "plan_config",
    "plan_for_eval",
    "plan_for_shapes",
    "plan_only",
    "request_of",
]
