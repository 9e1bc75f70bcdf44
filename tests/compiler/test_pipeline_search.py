"""The one stage search (``autoshard.pipeline.search``): ``compile`` and ``plan(pipeline="auto")`` both search with
it, each with what differs for it; ``compile`` never picks a schedule it cannot run; the search's shortcuts (kept
captures, layouts carried between sub-meshes, estimates) find what solving every configuration finds.

A deep, narrow GPT on fake worlds of A100 nodes: nothing runs, the cost model decides.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import autoshard
import autoshard.pipeline.compile_stages as pipeline_compile
import autoshard.pipeline.search as pipeline_search
from autoshard.cluster.meshes import fake_world
from autoshard.cluster.presets import get_cluster
from autoshard.config import PlanConfig
from autoshard.models.gpt import GPT, GPTConfig, gpt_example_inputs
from autoshard.plans.report import report
from autoshard.runtime.pipelined import EXECUTABLE_SCHEDULES
from autoshard.solver.inter_op import SCHEDULES, SPLIT_BACKWARD

DEEP = GPTConfig(n_layer=8, d_model=1024, n_head=8, vocab=512, seq_len=128)
CLUSTER = "a100-80gb:2x8"


def _deep() -> tuple[GPT, tuple]:
    with torch.device("meta"):
        model = GPT(DEEP)
    return model, gpt_example_inputs(DEEP, 4)


def _compile_choice(model: GPT, inputs: tuple) -> pipeline_compile.PipelineChoice:
    """What ``compile`` chooses on a (pp=2, dp=8) mesh, on a fake world (its solves broadcast from rank 0)."""
    with fake_world(16):
        mesh = init_device_mesh("cpu", (2, 8), mesh_dim_names=("pp", "dp"))
        return pipeline_compile.choose_pipeline(
            model, inputs, mesh, get_cluster(CLUSTER), PlanConfig(sample_layers=3), [2], None, None
        )


@pytest.fixture(scope="module")
def searched() -> tuple[autoshard.Plan, pipeline_compile.PipelineChoice, list[pipeline_search.SearchSpace]]:
    """The deep model's offline plan (``pipeline="auto"``) and compile's choice on the same cluster, made once for the
    tests below, with the search space each entry handed ``search_stages`` recorded (a spy on both modules)."""
    spaces: list[pipeline_search.SearchSpace] = []
    real = pipeline_search.search_stages

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        spaces.append(args[5])
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline_search, "search_stages", spy)
        mp.setattr(pipeline_compile, "search_stages", spy)
        model, inputs = _deep()
        plan = autoshard.plan(model, example_inputs=inputs, cluster=CLUSTER, pipeline="auto", solve_recipes=False)
        choice = _compile_choice(model, inputs)
    return plan, choice, spaces


def test_compile_and_plan_run_one_stage_search(searched) -> None:
    """Both entries call ``search_stages``: offline plans price boundaries as each device's share and may pick any
    schedule; compile prices them whole (its stages exchange Replicate activations), runs only what it can and
    neither recomputes nor falls back to recipes (it plans each stage itself)."""
    assert pipeline_compile.search_stages is pipeline_search.search_stages
    assert not hasattr(pipeline_search, "plan_split") and not hasattr(pipeline_compile, "best_split")
    plan, choice, spaces = searched
    offline, online = spaces
    assert offline.boundary == "share" and offline.schedules == SCHEDULES and offline.recompute is None
    assert online.boundary == "whole" and online.schedules == EXECUTABLE_SCHEDULES
    assert online.recompute is False and online.fallback == ()
    assert len(plan.stages) == choice.stages == 2


def test_compile_runs_every_schedule_an_offline_plan_may_pick(searched) -> None:
    """Every priced schedule runs, the zero-bubble one included (its stages' backward split in input and weight
    parts): where the offline plan takes it, compile's search on the same model and cluster takes it too, and
    the report no longer marks it as offline-only."""
    assert set(EXECUTABLE_SCHEDULES) == set(SCHEDULES) and set(SPLIT_BACKWARD) <= set(EXECUTABLE_SCHEDULES)
    plan, choice, _ = searched
    assert plan.schedule in SPLIT_BACKWARD and "does not run" not in report(plan)
    assert choice.split.schedule == plan.schedule, choice.split
    assert len(choice.stage_times) == len(choice.split.layers) and min(choice.stage_times) > 0


def test_the_search_finds_what_solving_every_configuration_finds() -> None:
    """On 8 nodes the estimate-guided search solves fewer configurations and picks the one solving every
    configuration picks; every configuration is listed, the estimated ones marked and last."""
    cfg = GPTConfig(n_layer=4, d_model=64, n_head=4, vocab=512, seq_len=128)
    with torch.device("meta"):
        model = GPT(cfg)
    inputs = gpt_example_inputs(cfg, 16)
    cluster, config = get_cluster("a100-80gb:8x8"), PlanConfig(sample_layers=2)
    every = pipeline_search.search_pipeline(model, inputs, cluster, config, exhaustive=True)
    some = pipeline_search.search_pipeline(model, inputs, cluster, config)
    assert not any(o.estimated for o in every) and any(o.estimated for o in some)
    assert len(some) == len(every) and not some[0].estimated and some[-1].estimated
    best, found = every[0], some[0]
    assert (found.stages, found.microbatches, found.split.schedule) == (
        best.stages,
        best.microbatches,
        best.split.schedule,
    )
    assert found.step_time_s == pytest.approx(best.step_time_s, rel=1e-9)


def test_pipelined_stages_are_balanced_to_a_tenth(searched) -> None:
    """Among splits as fast, the DP keeps the most balanced; interleaved ranks are balanced by rank (a rank's
    time is the sum over its chunks): the deep, narrow model's 2 stages are within 10% of each other."""
    plan = searched[0]
    times = [s.microbatch_time_s for s in plan.stages]
    assert len(times) == 2 and max(times) <= 1.10 * min(times), times


def test_the_plan_without_stages_from_the_kept_capture_is_the_plan() -> None:
    """``StageSolves.plan`` (the plan without stages planned on the search's capture of the whole batch) is what
    ``plan_graph`` makes from a capture of its own, wall-clock fields aside."""
    from autoshard.pipeline.blocks import main_sequence
    from autoshard.pipeline.solves import FakeStageMeshes, StageSolves
    from autoshard.search.recompute import plan_graph

    model, inputs = _deep()
    cluster, config = get_cluster(CLUSTER), PlanConfig(sample_layers=3, memory_budget=2**30)
    solves = StageSolves(model, inputs, config, FakeStageMeshes(cluster), main_sequence(model)[0])
    assert solves.costs(1, ((16,), ("dp",), 1)) is not None  # the whole batch's graph now has other layouts on it
    assert 1 in solves.captured
    with fake_world(16):
        mesh = init_device_mesh("cpu", (2, 8), mesh_dim_names=("dp", "tp"))
        kept = solves.plan(mesh, cluster, config)
        planned = plan_graph(model, inputs, mesh, cluster, config)
        fresh = planned.plan

    def still(p: autoshard.Plan) -> autoshard.Plan:
        return dataclasses.replace(p, solver=dataclasses.replace(p.solver, wall_s=0.0))

    assert still(kept).to_json() == still(fresh).to_json()


def test_megatron_and_the_plan_without_stages_made_alongside_are_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the recipes solved, Megatron's configurations and the plan without stages are made in a forked process
    while the search runs; the plan is the one made all in this process (sharing the search's solves)."""
    import autoshard.pipeline.plan_offline as pipeline_offline

    model, inputs = _deep()

    def plan() -> str:
        p = autoshard.plan(model, example_inputs=inputs, cluster=CLUSTER, pipeline="auto")
        return dataclasses.replace(p, solver=dataclasses.replace(p.solver, wall_s=0.0)).to_json()

    assert pipeline_offline._can_fork()
    forked = plan()
    monkeypatch.setattr(pipeline_offline, "_can_fork", lambda: False)
    assert plan() == forked
    names = {b.name for b in autoshard.Plan.from_json(forked).recipes}
    assert {"pp+tp+dp", "1 stage (no pipeline)"} <= names
