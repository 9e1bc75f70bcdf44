"""Planning for a cluster this process is not running on: a fake process group, fake tensors, a zoo model.

``autoshard.plan("llama3-70b", cluster="h100-sxm:128x8", seq=8192, global_batch=512)`` lands here. Nothing is
allocated and no device is touched: the model is built on the meta device, the mesh lives on torch's ``fake``
process group (any world size), and the planner prices everything with the cluster profile. The same path
serves ``autoshard.recipe(...)`` (a manual recipe as a Plan) and the ``autoshard plan`` CLI.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autoshard.cluster.meshes import default_mesh, fake_world, mesh_names
from autoshard.cluster.presets import get_cluster
from autoshard.cluster.profile import ClusterProfile, check_mesh
from autoshard.config import PlanConfig
from autoshard.cost.offload import host_is_device
from autoshard.errors import InfeasibleBudget, InputError
from autoshard.inputs import Call, as_call, example_call
from autoshard.models.zoo import ZooModel, get_model
from autoshard.notation import format_bytes
from autoshard.plans.plan import Plan
from autoshard.search.floor import refuse_below_floor
from autoshard.search.recipes_alone import plan_flat

if TYPE_CHECKING:
    import torch.fx as fx

    from autoshard.compiler.context import PassContext

log = logging.getLogger(__name__)

DEFAULT_SAMPLE_LAYERS = 3
Progress = Callable[[str, float, str], None]


@dataclasses.dataclass(frozen=True)
class ModelJob:
    """What is planned: the module, its global-shaped inputs, and (for zoo models) the work per step."""

    name: str
    module: nn.Module
    inputs: tuple | dict | Call  # the example call: positional, keyword, or both

    def first_input(self) -> Any:
        """The call's first argument (positional, else the first keyword's value): the batch for the checks."""
        args, kwargs = as_call(self.inputs)
        return args[0] if args else next(iter(kwargs.values()), None)

    tokens_per_step: int = 0
    flops_per_step: float = 0.0
    dtype: str = "bfloat16"
    params: int = 0


def resolve_model(
    model: str | ZooModel | nn.Module,
    example_inputs: Sequence[Any] | None,
    *,
    seq: int | None,
    global_batch: int | None,
    dtype: torch.dtype = torch.bfloat16,
) -> ModelJob:
    """A zoo name, a Hugging Face config.json path, a ZooModel or an nn.Module (with example inputs)."""
    if isinstance(model, nn.Module):
        if example_inputs is None:
            raise InputError(
                f"{type(model).__name__} is an nn.Module: pass example_inputs (global-shaped, real, fake or meta), "
                "or plan a zoo model by name (autoshard.models.zoo.known_models())"
            )
        params = sum(p.numel() for p in model.parameters())
        return ModelJob(type(model).__name__, model, example_call(example_inputs), params=params)
    zoo = model if isinstance(model, ZooModel) else get_model(str(model))
    if global_batch is None or global_batch < 1:
        raise InputError(f"planning {zoo.name} needs global_batch (sequences per step, >= 1), got {global_batch}")
    seq = seq or zoo.default_seq
    with torch.device("meta"):
        module = zoo.build(seq=seq, dtype=dtype, device="meta")
    inputs = (
        example_call(example_inputs)
        if example_inputs is not None
        else tuple(zoo.example_inputs(global_batch, seq, device="meta"))
    )
    return ModelJob(
        zoo.name,
        module,
        inputs,
        tokens_per_step=global_batch * zoo.tokens_per_sample(seq),
        flops_per_step=global_batch * zoo.train_flops_per_sample(seq),
        dtype=str(dtype).replace("torch.", ""),
        params=zoo.num_params(),
    )


def _check_batch(job: ModelJob, shape: Sequence[int], names: Sequence[str], recipe: str | None) -> None:
    """The batch must split over the data-parallel axes (every axis but ``tp`` and ``cp``, which split the hidden
    size and the sequence; recipes ddp/fsdp: every axis)."""
    first = job.first_input()
    if not isinstance(first, torch.Tensor) or first.ndim == 0:
        return
    batch = first.shape[0]
    dp_axes = [i for i, n in enumerate(names) if n not in ("tp", "cp")]
    if recipe in ("ddp", "fsdp"):
        dp_axes = list(range(len(shape)))
    degree = math.prod(shape[i] for i in dp_axes) if dp_axes else 1
    if batch % degree != 0:
        axes = " x ".join(f"{names[i]}={shape[i]}" for i in dp_axes)
        raise InputError(
            f"global batch {batch} is not divisible by the data-parallel degree {degree} ({axes}) of mesh "
            f"{tuple(shape)}; use a global batch that is a multiple of {degree} "
            f"(e.g. {degree * max(1, -(-batch // degree))}), or a mesh with fewer data-parallel devices"
        )


def _explain_oom(
    job: ModelJob, err: InfeasibleBudget, cluster: ClusterProfile, shape: Sequence[int], budget: int, offload: str
) -> str:
    n = math.prod(shape)
    itemsize = torch.empty((), dtype=getattr(torch, job.dtype)).element_size() if job.dtype else 2
    state = job.params * itemsize * 4  # parameters + gradients + AdamW's two moments, in the model's dtype
    need = err.least_bytes
    head = f"{job.name} does not fit on {n} x {format_bytes(budget)}"
    if job.params:
        head += (
            f": its training state alone (parameters + gradients + AdamW moments, {job.params / 1e9:.1f} B params "
            f"in {job.dtype}) is {format_bytes(state)}, and {n} x {format_bytes(budget)} = {format_bytes(n * budget)}"
        )
    tail = f"; the leanest plan on mesh {tuple(shape)} needs {format_bytes(need)} per device" if need else ""
    advice = "Use more devices, a smaller global batch or sequence"
    if need:
        # everything in the leanest plan is sharded over all devices, so its bytes scale with 1 / devices; the
        # activations (most of it when the state fits) scale with the batch
        factor = need / budget
        nodes = math.ceil(cluster.nodes * factor)
        first = job.first_input()
        batch = int(first.shape[0]) if isinstance(first, torch.Tensor) and first.ndim else 0
        # (a smaller batch only helps where accumulation has not already tried smaller micro-batches)
        smaller = _round_down_pow2(int(batch / factor)) if batch and not err.accumulation else 0
        advice = (
            f"Estimated from the {factor:.2f}x overshoot: about {nodes * cluster.devices_per_node} devices (e.g. "
            f"'{cluster.name.split(':')[0]}:{nodes}x{cluster.devices_per_node}')"
            + (f", or a global batch of at most about {smaller}" if smaller >= 1 else "")
            + ", or a shorter sequence"
            + (", or offload='params' (--offload params)" if offload == "none" and not host_is_device(cluster) else "")
        )
    tried = (
        ""
        if not err.accumulation
        else (
            f" Gradient accumulation: {err.accumulation}."
            if "would fit" in err.accumulation
            else f" Gradient accumulation does not fit either ({err.accumulation})."
        )
    )
    return (
        f"{head}{tail} (everything sharded as far as the mesh allows, activations of the whole batch included).{tried} "
        f"{advice}, or raise --memory-per-device, or let pipeline stages split the layers and the batch into "
        "micro-batches (pipeline='auto', --pipeline auto)."
    )


def _round_down_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1) if n >= 1 else 0


PIPELINE_MODES = ("none", "auto")


@dataclasses.dataclass(frozen=True, eq=False)
class OfflineRequest:
    """A request to plan for a cluster this process is not part of, resolved (``offline_request``): the model built
    on meta with its example call (``job``), the cluster's profile, the mesh (a DeviceMesh of a fake world, or None:
    made from ``shape`` and ``names``), the stage count a ``pp`` axis fixes (None: none fixed), the options with
    their budget, the micro-batch count asked for and whether ``pipeline="auto"`` weighs stages."""

    job: ModelJob
    prof: ClusterProfile
    mesh: DeviceMesh | None
    shape: tuple[int, ...]
    names: tuple[str, ...]
    stages: int | None
    cfg: PlanConfig
    microbatches: int | None
    progress: Progress | None
    weigh_stages: bool

    @property
    def pipelined(self) -> bool:
        """Whether the stage search runs: a ``pp`` axis of more than one stage, or ``pipeline="auto"``."""
        return self.stages is not None or self.weigh_stages


def offline_request(
    model: str | ZooModel | nn.Module,
    *,
    cluster: str | ClusterProfile,
    mesh: DeviceMesh | Sequence[int] | Mapping[str, int] | None = None,
    example_inputs: Sequence[Any] | None = None,
    seq: int | None = None,
    global_batch: int | None = None,
    memory_budget: int | str | None = None,
    config: PlanConfig | None = None,
    dtype: torch.dtype = torch.bfloat16,
    progress: Progress | None = None,
    pipeline: str = "none",
    microbatches: int | None = None,
) -> OfflineRequest:
    """Plan ``model`` for ``cluster`` without its devices: the request checked and resolved. ``mesh`` is a shape
    (default: nodes x devices per node), ``{axis name: size}`` outer axis first, or a DeviceMesh; the memory budget
    defaults to the device's memory. A zoo model is built in ``dtype``, or in float32 under
    ``config.mixed_precision`` (fp32 masters, gradients and optimizer state; the step in bf16 by
    ``config.precision_policy``).

    Pipeline stages: ``pipeline="auto"`` searches stage counts, micro-batches and schedules
    (``autoshard.pipeline.search``) and the pipelined plan is returned when more than one stage is fastest, else
    the usual plan (the log says why). A mesh whose outermost axis is named ``"pp"`` fixes the stage count to
    that axis's size; the other axes are each stage's sub-mesh (``autoshard/dispatch.py: plan_only`` decides).

    Gradient accumulation (no pipeline stages): ``microbatches=k`` plans one of k micro-batches of the global
    batch, each step running k of them; without it, when no plan of the whole batch fits the budget, the
    fewest micro-batches that fit and the next count are planned and the faster step is returned
    (``plan.microbatches`` and the report say how many)."""
    if pipeline not in PIPELINE_MODES:
        raise InputError(f"pipeline={pipeline!r} is not known; use one of {PIPELINE_MODES}")
    prof = get_cluster(cluster)
    base = config or PlanConfig()
    if isinstance(mesh, DeviceMesh):
        shape, names = tuple(mesh.shape), tuple(mesh.mesh_dim_names or mesh_names(mesh.shape))
    elif isinstance(mesh, Mapping):
        shape, names = tuple(int(s) for s in mesh.values()), tuple(str(n) for n in mesh)
    elif mesh is not None:
        shape = tuple(int(s) for s in mesh)
        names = mesh_names(shape)
    else:
        shape, names = default_mesh(prof)
    check_mesh(prof, shape)
    stages = None
    if "pp" in names:
        if names[0] != "pp" or len(shape) < 2:
            raise InputError(
                f"mesh {dict(zip(names, shape))}: 'pp' must be the outermost axis, followed by the "
                "axes of each stage's sub-mesh, e.g. {'pp': 4, 'tp': 8}"
            )
        stages, shape, names = shape[0], shape[1:], names[1:]
        stages = stages if stages > 1 else None  # pp=1: the plain plan of the other axes
        if isinstance(mesh, DeviceMesh):
            mesh = None  # each stage plans on a sub-mesh of its own fake world
    budget = memory_budget if memory_budget is not None else (base.memory_budget or prof.device.memory_bytes)
    if (isinstance(budget, str) and budget.strip().lower() == "none") or base.reuse is not None:
        budget = None  # (plan=saved replays its choices: no budget, no recomputation search)
    sample = base.sample_layers if base.sample_layers is not None else DEFAULT_SAMPLE_LAYERS
    cfg = dataclasses.replace(base, memory_budget=budget, sample_layers=sample)
    # mixed precision: the model's parameters in fp32 (the masters), cast to bf16 by the precision policy
    job = resolve_model(
        model, example_inputs, seq=seq, global_batch=global_batch, dtype=torch.float32 if cfg.mixed_precision else dtype
    )
    _check_batch(job, shape, names, cfg.recipe)
    if progress:
        where = f"{stages} stages of {tuple(shape)}" if stages else f"mesh {tuple(shape)}"
        progress("model", 1.0, f"{job.name}: {job.params / 1e9:.2f} B parameters, {where} on {prof.name}")
    if microbatches is not None and (stages is not None or pipeline == "auto"):
        raise InputError(
            f"microbatches={microbatches} is gradient accumulation without pipeline stages; with "
            "pipeline stages the search chooses the micro-batches (drop one of the two)"
        )
    if microbatches is not None and (microbatches < 1 or int(microbatches) != microbatches):
        raise InputError(f"microbatches={microbatches} must be a whole number >= 1")
    refuse_below_floor(job.module, cfg, prof, math.prod(shape) * (stages or 1), job.name)  # before any capture
    dm = mesh if isinstance(mesh, DeviceMesh) else None
    return OfflineRequest(
        job, prof, dm, tuple(shape), tuple(names), stages, cfg, microbatches, progress, pipeline == "auto"
    )


def plan_flat_offline(req: OfflineRequest, solves: Any = None, report: bool = True) -> Plan:
    """The request's plan without pipeline stages (with the stage search's ``solves``: its capture of the whole
    batch planned instead of capturing again; ``report``: show progress)."""
    return _plan_flat(
        req.job,
        req.prof,
        req.mesh,
        req.shape,
        req.names,
        req.cfg,
        req.progress if report else None,
        solves,
        req.microbatches,
    )


def with_model_figures(req: OfflineRequest, plan: Plan) -> Plan:
    """``plan`` with the model's name, tokens and FLOPs per step and the device's peak FLOPs (for MFU)."""
    compute = req.cfg.mixed_precision or req.job.dtype
    peak = req.prof.device.peak_flops.get(compute, req.prof.device.peak_flops["float32"])
    return dataclasses.replace(
        plan,
        model=req.job.name,
        tokens_per_step=req.job.tokens_per_step,
        model_flops_per_step=req.job.flops_per_step,
        peak_flops_per_device=peak,
    )


def _plan_flat(
    job: ModelJob,
    prof: ClusterProfile,
    mesh: DeviceMesh | Any,
    shape: tuple[int, ...],
    names: tuple[str, ...],
    cfg: PlanConfig,
    progress: Progress | None,
    solves: Any = None,
    microbatches: int | None = None,
) -> Plan:
    """The intra-op plan of the whole batch on ``shape`` (no pipeline stages), or of its micro-batches
    (``search/accumulate.py``: given, or searched when the whole batch does not fit); with the stage search's
    ``solves`` (``pipeline.solves.StageSolves``) its capture of the whole batch is planned instead of capturing
    again."""
    with fake_world(math.prod(shape)):
        dm = mesh if isinstance(mesh, DeviceMesh) else init_device_mesh("cpu", shape, mesh_dim_names=names)
        try:
            if solves is not None:
                return solves.plan(dm, prof, cfg, progress)
            planned, _ = plan_flat(
                job.module, job.inputs, dm, prof, cfg, False, microbatches, weigh_next=True, progress=progress
            )
            _say_offload(planned.graph, planned.ctx, progress)
            return planned.plan
        except InfeasibleBudget as e:  # (a SolverTimeout is not an out-of-memory verdict: it passes through)
            raise InfeasibleBudget(
                _explain_oom(job, e, prof, shape, cfg.memory_budget, cfg.offload), e.least_bytes, e.accumulation
            ) from None


def _say_offload(gm: fx.GraphModule, ctx: PassContext, progress: Progress | None) -> None:
    """Log (and show as ``autoshard plan``'s progress) what the plan holds in host memory, if anything."""
    from autoshard.compiler.parameter_forms import offload_summary
    from autoshard.plans.report import offload_text

    found = offload_summary(gm, ctx)
    if found is None:
        return
    text = offload_text(found.mode, found.params, found.total, found.host_bytes, found.step_s, found.link)
    log.info("%s", text)
    if progress:
        progress("offload", 1.0, text.removeprefix("offload: "))


__all__ = [
    "PIPELINE_MODES",
    "OfflineRequest",
    "offline_request",
    "plan_flat_offline",
    "resolve_model",
    "with_model_figures",
]
