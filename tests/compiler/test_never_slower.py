"""The plan is never slower than any recipe planned alone, and each recipe row is that recipe's plan alone.

Memory-bound cases on fake groups (the budget a share of what saving every activation needs): on a 1-D and a 2-D
mesh, several budgets, without and with pipeline stages. ``autoshard.plan(..., recipe=R)`` is what
``autoshard plan --recipe R`` runs: its own recomputation and gradient-accumulation searches
(``autoshard/search/recipes_alone.py``).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import autoshard
from autoshard.cluster.meshes import fake_world
from autoshard.errors import InfeasibleBudget


class _Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class _Stack(torch.nn.Module):
    def __init__(self, d: int = 64, n: int = 4) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Block(d) for _ in range(n))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return torch.nn.functional.mse_loss(x, y)


def _check(plan: autoshard.Plan, alone_of, budget: int) -> int:
    """Every recipe that fits alone is no faster than the plan, and its row is its plan alone; returns how many
    rows needed recomputation or micro-batches (the case was memory-bound for them)."""
    bound = 0
    for row in plan.recipes:
        if not row.applies:
            continue
        try:
            alone = alone_of(row.name)
        except InfeasibleBudget:
            assert not row.fits, f"{row.name}: the row fits but the recipe alone does not"
            continue
        fits = alone.peak_memory.total <= budget
        assert row.fits == fits, (row.name, row.fits, alone.peak_memory.total, budget)
        if not fits:
            continue
        assert plan.step_time_s <= alone.step_time_s * (1 + 1e-9), (
            f"the plan ({plan.step_time_s:.6g} s) is slower than {row.name} alone ({alone.step_time_s:.6g} s)"
        )
        assert row.step_time_s == pytest.approx(alone.step_time_s, rel=1e-6), row
        assert row.microbatches == alone.microbatches and bool(row.recompute) == bool(alone.recompute_layers), row
        bound += bool(row.recompute) or row.microbatches > 1
    return bound


@pytest.mark.parametrize("shape,names,shares", [((4,), ("dp",), (0.7, 0.4)), ((2, 2), ("dp", "tp"), (0.7,))])
def test_plan_never_slower_than_a_recipe_planned_alone(shape, names, shares):
    with torch.device("meta"):
        model = _Stack()
    inputs = (torch.randn(256, 64), torch.randn(256, 64))
    bound = 0
    with fake_world(math.prod(shape)):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        need = autoshard.plan(model, mesh, inputs).peak_memory.total
        for share in shares:
            budget = int(share * need)
            try:
                plan = autoshard.plan(model, mesh, inputs, memory_budget=budget)
            except InfeasibleBudget:
                continue
            assert plan.peak_memory.total <= budget
            bound += _check(
                plan,
                lambda r, budget=budget: autoshard.plan(model, mesh, inputs, memory_budget=budget, recipe=r),
                budget,
            )
    assert bound, "no recipe needed recomputation or micro-batches: the cases were not memory-bound"


def test_pipelined_plan_never_slower_than_the_recipes():
    """With pipeline="auto" the plan is the faster of the pipelined search's choice and the plan without stages
    (its recipes priced alone): no slower than any recipe row, each a recipe planned alone without stages."""
    with torch.device("meta"):
        model = _Stack(n=4)
    inputs = (torch.randn(1024, 64), torch.randn(1024, 64))
    kw = dict(example_inputs=inputs, cluster="h100-sxm:1x4", mesh=(4,), sample_layers=None)
    need = autoshard.plan(model, **kw).peak_memory.total
    budget = int(0.4 * need)
    plan = autoshard.plan(model, **kw, memory_budget=budget, pipeline="auto")
    flat_rows = [r for r in plan.recipes if r.applies and r.fits and r.name not in ("pp+tp+dp", "no stages")]
    assert flat_rows
    assert all(plan.step_time_s <= r.step_time_s * (1 + 1e-9) for r in plan.recipes if r.applies and r.fits)
    _check(
        dataclass_without_pipeline_rows(plan),
        lambda r: autoshard.plan(model, **kw, memory_budget=budget, recipe=r),
        budget,
    )


def dataclass_without_pipeline_rows(plan: autoshard.Plan) -> autoshard.Plan:
    import dataclasses

    return dataclasses.replace(plan, recipes=tuple(r for r in plan.recipes if r.name not in ("pp+tp+dp", "no stages")))


def test_each_alone_in_side_processes_as_here_and_the_micro_batch_floor():
    """The recipes' searches give the same answers in forked processes as one after the other here (a Plan back,
    or the InfeasibleBudget's message and least bytes); the floor a whole batch's failure proves for k
    micro-batches: what does not shrink, plus the rest over k."""
    from types import SimpleNamespace

    from autoshard.search.recipes_alone import each_alone

    def one(name: str):
        if name == "tp":
            raise InfeasibleBudget(f"no {name} fits", 123)
        return SimpleNamespace(plan=f"plan of {name}"), None

    names = ["fsdp", "tp", "cp"]
    here, forked = each_alone(names, one, parallel=False), each_alone(names, one, parallel=True)
    assert list(here) == list(forked) == names
    assert (
        [here[n].plan for n in ("fsdp", "cp")]
        == [forked[n].plan for n in ("fsdp", "cp")]
        == ["plan of fsdp", "plan of cp"]
    )
    assert here["fsdp"].found is not None  # (a side process sends its Plan only: one core runs them here)
    assert (forked["fsdp"].found is None) == ((os.cpu_count() or 1) > 1)
    assert str(forked["tp"]) == str(here["tp"]) == "no tp fits" and forked["tp"].least_bytes == 123
    e = InfeasibleBudget("x", 100, fixed_bytes=40)
    assert e.micro_floor(1) == 100 and e.micro_floor(2) == 70 and e.micro_floor(4) == 55
    assert InfeasibleBudget("x", 100).micro_floor(2) is None
    floored = InfeasibleBudget("x", 100, fixed_bytes=40, step_floor=60)  # (the step's floor: no k goes below it)
    assert floored.micro_floor(2) == 70 and floored.micro_floor(4) == 60
    assert InfeasibleBudget("x", step_floor=60).micro_floor(8) == 60


def test_step_floor_is_below_every_plans_peak_and_rules_out_what_cannot_fit():
    """``solve_memory.step_floor``: no plan of the program (any recipe's pins, any micro-batch count) peaks below it,
    and a budget under it is refused without planning a micro-batch count."""
    from autoshard.cluster.presets import get_cluster
    from autoshard.compiler.solve_memory import step_floor
    from autoshard.compiler.solve_recipes import recipe_pins
    from autoshard.config import PlanConfig
    from autoshard.search.recompute import plan_graph

    with torch.device("meta"):
        model = _Stack()
    inputs = (torch.randn(256, 64), torch.randn(256, 64))
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        planned = plan_graph(model, inputs, mesh, get_cluster("h100-sxm:1x4"), PlanConfig())
        floor = step_floor(planned.ctx)
        assert 0 < floor <= planned.plan.peak_memory.total
        for r in planned.plan.recipes:
            if r.applies:
                pins, _ = recipe_pins(r.name, planned.graph, planned.ctx)
                assert floor <= step_floor(planned.ctx, pins) <= r.peak_memory_bytes, r.name
        with pytest.raises(InfeasibleBudget) as e:
            autoshard.plan(model, mesh, inputs, memory_budget=floor - 1)
    assert "at least" in str(e.value) or "none" in str(e.value), str(e.value)


@pytest.mark.slow
def test_micro_batches_instead_of_recomputation_where_faster():
    """A batch that fits whole only by recomputing every layer (GPT-2 124M, 64 x 1024 tokens on 8 H100s under
    4 GB): two micro-batches that recompute nothing step faster, and the plan takes them; planned whole
    (``microbatches=1``) it recomputes."""
    common = dict(cluster="h100-sxm:1x8", seq=1024, global_batch=64, memory_budget="4GB")
    plan = autoshard.plan("gpt2-124m", **common)
    whole = autoshard.plan("gpt2-124m", microbatches=1, **common)
    assert whole.recompute_layers and whole.microbatches == 1
    assert plan.microbatches == 2 and not plan.recompute_layers
    assert plan.step_time_s < whole.step_time_s and plan.peak_memory.total <= 4e9
    best = plan.best_recipe()
    assert best is not None and plan.step_time_s <= best.step_time_s + 1e-12
    # the floor that decides whether a count is planned (search/accumulate.py): the unbudgeted plan of 2, which
    # the budgeted one may undercut only within the slack (its step is the plan's count, not the objective)
    from autoshard.search.accumulate import FLOOR_SLACK

    free = autoshard.plan(
        "gpt2-124m",
        cluster="h100-sxm:1x8",
        seq=1024,
        global_batch=64,
        memory_budget="none",
        microbatches=2,
        solve_recipes=False,
    )
    assert free.solver.bound_s * 2 * (1 - FLOOR_SLACK) <= plan.step_time_s <= whole.step_time_s
