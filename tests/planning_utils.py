"""Helpers for planning tests: run the planning passes on a fake process group, no real ranks."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from autoshard.cluster import get_cluster
from autoshard.config import PlanConfig
from autoshard.planner import plan_graph


def plan_on(model: nn.Module, inputs: tuple, shape: tuple[int, ...], names: tuple[str, ...], cluster: str = "cpu", **cfg: Any):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return plan_graph(model, inputs, mesh, get_cluster(cluster), PlanConfig(**cfg))
