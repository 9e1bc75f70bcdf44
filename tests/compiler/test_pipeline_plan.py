"""Pipelined plans (issue 4, plan and report): which models get stages, and what the Plan says about them.

Small GPTs on fake worlds of A100/H100 nodes; nothing runs, the cost model decides. The deep, narrow model's
plan is made once (module fixture) and checked from several sides.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

import autoshard
from autoshard.models.gpt import GPT, GPTConfig, gpt_example_inputs
from autoshard.pipeline.plan import FLAT_NAME
from autoshard.plans.plan import Plan
from autoshard.plans.report import report

BALANCE = 1.25  # the slowest stage's time per micro-batch is at most this factor of the fastest's
DEEP = GPTConfig(n_layer=8, d_model=1024, n_head=8, vocab=512, seq_len=128)


def _deep_narrow() -> tuple[GPT, tuple]:
    with torch.device("meta"):
        model = GPT(DEEP)
    return model, gpt_example_inputs(DEEP, 4)


@pytest.fixture(scope="module")
def piped() -> Plan:
    """8 layers of width 1024 on 2 A100 nodes (25 GB/s per GPU between nodes, 300 GB/s inside one)."""
    model, inputs = _deep_narrow()
    return autoshard.plan(model, example_inputs=inputs, cluster="a100-80gb:2x8", pipeline="auto", solve_recipes=False)


def test_deep_narrow_model_on_a_slow_network_gets_stages_across_nodes(piped: Plan) -> None:
    assert len(piped.stages) == 2 and piped.mesh.names[0] == "pp" and piped.mesh.shape == (2, 8)
    # each stage is one whole node: the slow network only carries the boundary sends
    nodes = [{r // 8 for r in s.ranks} for s in piped.stages]
    assert nodes == [{0}, {1}]
    assert [s.ranks for s in piped.stages] == [tuple(range(8)), tuple(range(8, 16))]
    flat = next(b for b in piped.recipes if b.name == FLAT_NAME)
    assert piped.step_time_s < flat.step_time_s
    assert piped.schedule and piped.microbatches >= 2 and 0 < piped.bubble_fraction < 0.5


def test_pipelined_stages_are_balanced(piped: Plan) -> None:
    times = [s.microbatch_time_s for s in piped.stages]
    assert min(times) > 0 and max(times) <= BALANCE * min(times), times
    # a stage is busy B x its micro-batch time plus its once-per-step gradient work, which the plan splits
    for s in piped.stages:
        assert s.compute_s + s.comm_s >= piped.microbatches * s.microbatch_time_s * (1 - 1e-9)
        assert s.compute_s > 0 and s.comm_s > 0


def test_stages_hold_every_layer_once_with_the_embedding_first_and_the_head_last(piped: Plan) -> None:
    first, last = piped.stages[0], piped.stages[-1]
    layers = [n for s in piped.stages for n in s.layers if n.startswith("layers.")]
    assert sorted(layers, key=lambda n: int(n.split(".")[1])) == [f"layers.{i}" for i in range(8)]
    assert len(set(layers)) == 8
    assert first.layers[:2] == ("wte", "wpe") and last.layers[-1] == "ln_f"
    assert "ln_f" not in first.layers and "wpe" not in last.layers
    # every parameter of the model has a layout, each stage only its own (the tied head reads wte on the last)
    model, _ = _deep_narrow()
    assert set(piped.parameter_placements()) == {n for n, _ in model.named_parameters()}
    names = [{t.name for t in s.tensors} for s in piped.stages]
    assert "wpe.weight" in names[0] and "wpe.weight" not in names[1] and "ln_f.weight" in names[1]
    for s in piped.stages:
        mine = {n for n in s.layers if n.startswith("layers.")}
        assert {".".join(t.name.split(".")[:2]) for t in s.tensors if t.name.startswith("layers.")} <= mine
        assert all(len(t.placements) == len(s.mesh.shape) for t in s.tensors)
    assert len(piped.input_placements()) == 2  # tokens on the first stage, targets on the last


def test_stage_memory_includes_in_flight_activations(piped: Plan) -> None:
    for s in piped.stages:
        m = s.memory
        assert m.parameters > 0 and m.activations > 0 and m.optimizer == pytest.approx(2 * m.parameters, rel=0.01)
    assert piped.peak_memory.total == max(s.memory.total for s in piped.stages)
    # stage 0 keeps the most micro-batches in flight under every 1F1B-family schedule, and holds the embeddings
    assert piped.stages[0].memory.activations >= piped.stages[-1].memory.activations
    sends = [c for s in piped.stages for c in s.collectives if c.kind == "send_recv"]
    # two sends (activation forward, its gradient backward) per micro-batch and model chunk on each rank, each
    # of this device's share of the boundary activation f32[4 / B, 128, 1024] over the stage's 8 devices
    assert len(sends) == 4 and all(c.axis == "pp" and c.repeat == piped.microbatches * piped.chunks for c in sends)
    share = 4 // piped.microbatches * 128 * DEEP.d_model * 4 // 8
    assert all(abs(c.nbytes - share) <= 1 for c in sends), (share, sends)


def test_pipelined_plan_json_round_trip_and_old_json_loads(piped: Plan) -> None:
    text = piped.to_json()
    again = Plan.from_json(text)
    assert again == piped and again.to_json() == text
    assert again.stages[1].microbatch_time_s == piped.stages[1].microbatch_time_s > 0
    # a plan written before pipelines (no chunks / bubble / per-stage time fields) still loads, as one stage
    d = json.loads(text)
    for key in ("chunks", "bubble_fraction"):
        del d[key]
    for s in d["stages"]:
        del s["microbatch_time_s"]
    old = Plan.from_json(json.dumps(d))
    assert old.chunks == 1 and old.bubble_fraction == 0.0 and old.stages[0].microbatch_time_s == 0.0
    assert old.stages[0].layers == piped.stages[0].layers


def test_report_shows_the_pipeline(piped: Plan) -> None:
    r = report(piped)
    assert "pipeline: 2 stages" in r and f"{piped.microbatches} micro-batches" in r and "bubble" in r
    assert f"schedule {piped.schedule}" in r and "stage balance" in r
    table = r[r.index("pipeline: 2 stages") :]
    assert "0–7" in table and "8–15" in table and "dp=8" in table
    assert "== stage 0  mesh dp=8  ranks 0–7  layers wte, wpe" in r and "== stage 1  mesh dp=8  ranks 8–15" in r
    rows = {line.split()[0]: line for line in table.splitlines()[2:4]}
    assert rows["0"].split("  ")[-1].startswith("wte, wpe, layers.") and rows["1"].rstrip().endswith(", ln_f")
    assert "send_recv" in r and FLAT_NAME in r


def test_model_that_fits_one_node_gets_no_stages(caplog: pytest.LogCaptureFixture) -> None:
    """A shallow, wide GPT with a large vocabulary on one node of 4 H100s: a pipeline would leave the output
    head's stage the slowest by far, and NVLink makes the plain plan's gradient reduction cheap."""
    cfg = GPTConfig(n_layer=2, d_model=512, n_head=4, vocab=32000, seq_len=256)
    with torch.device("meta"):
        model = GPT(cfg)
    with caplog.at_level(logging.INFO, logger="autoshard.pipeline"):
        plan = autoshard.plan(
            model,
            example_inputs=gpt_example_inputs(cfg, 4),
            cluster="h100-sxm:1x4",
            pipeline="auto",
            solve_recipes=False,
        )
    assert len(plan.stages) == 1 and "pp" not in plan.mesh.names and plan.schedule is None
    assert any("no stages: one stage is fastest" in m for m in caplog.messages), caplog.messages


def test_a_pp_mesh_axis_fixes_the_stage_count_and_names_the_sub_mesh() -> None:
    model, inputs = _deep_narrow()
    plan = autoshard.plan(
        model, {"pp": 2, "tp": 8}, example_inputs=inputs, cluster="a100-80gb:2x8", solve_recipes=False
    )
    assert len(plan.stages) == 2 and plan.mesh.names == ("pp", "tp")
    assert all(s.mesh.names == ("tp",) for s in plan.stages)
    assert {c.axis for s in plan.stages for c in s.collectives} <= {"tp", "pp"}
    with pytest.raises(ValueError, match=r"possible stage counts: \[1, 2\]"):
        autoshard.plan(model, {"pp": 4, "tp": 4}, example_inputs=inputs, cluster="a100-80gb:2x8")
    with pytest.raises(ValueError, match="'pp' must be the outermost axis"):
        autoshard.plan(model, {"tp": 8, "pp": 2}, example_inputs=inputs, cluster="a100-80gb:2x8")


def test_pipeline_mode_is_checked() -> None:
    model, inputs = _deep_narrow()
    with pytest.raises(ValueError, match="pipeline='always' is not known"):
        autoshard.plan(model, example_inputs=inputs, cluster="a100-80gb:2x8", pipeline="always")


def test_a_model_without_repeated_layers_gets_no_stages(caplog: pytest.LogCaptureFixture) -> None:
    class Mlp(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(64, 256), torch.nn.Linear(256, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(torch.relu(self.fc1(x))).square().mean()

    with torch.device("meta"):
        model = Mlp()
    x = torch.randn(16, 64, device="meta")
    with caplog.at_level(logging.INFO, logger="autoshard.pipeline"):
        plan = autoshard.plan(model, example_inputs=(x,), cluster="a100-80gb:2x8", pipeline="auto", solve_recipes=False)
    assert len(plan.stages) == 1 and plan.mesh.names == ("dp", "tp")
    assert any("no stages" in m and "no sequence of blocks" in m for m in caplog.messages), caplog.messages


def test_pipeline_planning_needs_the_offline_path() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from autoshard.cluster.meshes import fake_world

    model, inputs = _deep_narrow()
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        with pytest.raises(ValueError, match="pipeline planning runs on the offline path"):
            autoshard.plan(model, mesh, inputs, pipeline="auto")


@pytest.mark.slow
def test_a_tight_memory_budget_is_met_by_every_stage() -> None:
    """At 300 MiB per device the deep, narrow model's plan without stages needs sharded parameters on the slow
    network; the pipelined plan fits every stage (recomputing activations if it must) and is faster."""
    with torch.device("meta"):
        model = GPT(DEEP)
    budget = 300 * 2**20
    plan = autoshard.plan(
        model,
        example_inputs=gpt_example_inputs(DEEP, 8),
        cluster="a100-80gb:2x8",
        pipeline="auto",
        solve_recipes=False,
        memory_budget=budget,
    )
    assert len(plan.stages) == 2 and plan.memory_budget_bytes == budget
    assert all(0 < s.memory.total <= budget for s in plan.stages)
    flat = next(b for b in plan.recipes if b.name == FLAT_NAME)
    assert plan.step_time_s < flat.step_time_s
    assert ("activation recomputation" in report(plan)) == plan.recompute
