"""The public entry points: ``autoshard.plan`` and ``autoshard.compile``."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autoshard import _torch_compat as tc
from autoshard.cluster import ClusterProfile, get_cluster
from autoshard.config import PlanConfig
from autoshard.plan import Plan
from autoshard.planner import plan_graph
from autoshard.runtime.program import BACKENDS, CompiledProgram, InterpretedProgram
from autoshard.runtime.sharded_module import ShardedModule

log = logging.getLogger(__name__)


def _config(memory_budget: Any, constraints: Mapping | None, **kw: Any) -> PlanConfig:
    return PlanConfig(memory_budget=memory_budget, constraints=dict(constraints or {}), **kw)


def _check_inputs(example_inputs: Any) -> tuple:
    if example_inputs is None:
        raise ValueError("example_inputs is required: a tuple of global-shaped tensors (real, fake or meta) for forward")
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    return tuple(example_inputs)


def plan(
    model: nn.Module,
    mesh: DeviceMesh,
    example_inputs: Sequence[Any],
    *,
    cluster: str | ClusterProfile | None = None,
    memory_budget: int | str | None = None,
    constraints: Mapping[str, Any] | None = None,
    **options: Any,
) -> Plan:
    """Plan ``model`` on ``mesh`` without running it (works on a fake process group, any device count)."""
    p, _, _ = plan_graph(
        model, _check_inputs(example_inputs), mesh, get_cluster(cluster), _config(memory_budget, constraints, **options)
    )
    return p


def compile(  # noqa: A001 - the one-line API the project promises
    model: nn.Module,
    mesh: DeviceMesh,
    example_inputs: Sequence[Any],
    *,
    cluster: str | ClusterProfile | None = None,
    memory_budget: int | str | None = None,
    constraints: Mapping[str, Any] | None = None,
    backend: str = "inductor",
    **options: Any,
) -> ShardedModule:
    """Plan, lower and compile ``model`` for this rank; returns a trainable ``ShardedModule``.

    ``example_inputs`` are global-shaped. The returned module takes this rank's local input pieces
    (``sharded.shard_inputs(*global_tensors)``) and returns the loss, equal on every rank.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not known; use one of {BACKENDS}")
    inputs = _check_inputs(example_inputs)
    real_group = dist.is_initialized() and dist.get_world_size() > 1 and not tc.in_local_tensor_mode()
    p, gm, ctx = plan_graph(
        model, inputs, mesh, get_cluster(cluster), _config(memory_budget, constraints, **options), real_group
    )
    if tc.in_local_tensor_mode():
        log.info("compile: LocalTensorMode: running the plan with the DTensor interpreter (no per-rank graph)")
        program: Any = InterpretedProgram(gm, ctx)
    else:
        program = CompiledProgram(gm, ctx, backend)
    grad_names = [r.name for r in ctx.output_roles if r.kind == "grad"]
    sharded = ShardedModule(model, mesh, p, program, grad_names)
    sharded.timings = dict(ctx.timings)
    return sharded
