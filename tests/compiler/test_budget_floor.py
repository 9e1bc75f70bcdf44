"""The state floor (``autoshard/search/floor.py``) is a lower bound: no plan the solver finds, at any budget, with or
without offload, needs less than it; a budget below it is refused before capture on the mesh path too."""

from __future__ import annotations

import pytest
import torch

import autoshard
from autoshard.cluster.presets import get_cluster
from autoshard.config import PlanConfig
from autoshard.errors import InfeasibleBudget
from autoshard.models.zoo import get_model
from autoshard.search.floor import state_floor

CLUSTER = "h100-sxm:1x8"


@pytest.mark.parametrize("offload", ["none", pytest.param("auto", marks=pytest.mark.slow)])
def test_no_plan_needs_less_than_the_floor(offload: str) -> None:
    """GPT-2 124M on 8 H100s: the plan without a tight budget, and under budgets that force sharding (or find
    nothing: then the solver's own least bytes), never below the floor of the same options."""
    zoo = get_model("gpt2-124m")
    model = zoo.build(seq=256)
    floor = state_floor(model, PlanConfig(offload=offload), get_cluster(CLUSTER), 8)
    assert floor.least_bytes == (floor.state_bytes / 8 if offload == "none" else floor.params_bytes / 8)
    seen = 0
    for budget in (None, "400MB"):
        try:
            plan = autoshard.plan(
                "gpt2-124m", cluster=CLUSTER, seq=256, global_batch=8, offload=offload, memory_budget=budget
            )
        except InfeasibleBudget as e:
            assert e.least_bytes is None or e.least_bytes >= floor.least_bytes, (budget, e)
            continue
        seen += 1
        assert plan.peak_memory.total >= floor.least_bytes, (budget, plan.peak_memory.total, floor)
    assert seen >= 1


def test_compile_refuses_a_budget_under_the_floor_before_capturing(monkeypatch) -> None:
    """compile on a DeviceMesh (LocalTensorMode, 2 ranks): the whole state of a 4 MiB model cannot fit 1 MiB per
    device on 2 CPU devices (host memory is theirs: no offload), refused without tracing the model."""
    from harness import local_ranks
    from torch.distributed.device_mesh import init_device_mesh

    def refuse(*a, **k):
        raise AssertionError("captured")

    monkeypatch.setattr("autoshard.compiler.runner.capture_model", refuse)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))  # 2 x 1 MiB of fp32 weights
    with local_ranks(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        with pytest.raises(InfeasibleBudget, match=r"Sequential cannot train on 2 x 1\.00 MiB: its training state"):
            autoshard.compile(model, mesh, (torch.randn(4, 512),), memory_budget="1MiB", backend="eager")
