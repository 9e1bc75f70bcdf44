"""The step per block (``StagePlan.layer_times``, the page's per-layer view) adds up to each stage's predicted
time: on a sampled flat plan, an accumulated one and a pipelined 3-D plan. Each copy of a layer carries its own
work (not every copy's collectives on one layer), and once-a-step work is counted once, not per micro-batch."""

from __future__ import annotations

import pytest

import autoshard
from autoshard.plans.html.page import render_html
from autoshard.plans.plan import Plan


def _rows_add_up(plan: Plan) -> None:
    for s in plan.stages:
        assert s.layer_times, f"stage {s.index} has no per-layer rows"
        total = sum(r.per_step_s for r in s.layer_times)
        assert total == pytest.approx(s.compute_s + s.comm_s, rel=1e-9), s.index
        assert total <= plan.step_time_s * (1 + 1e-9)  # (the rest of the step: the pipeline's idle time)


def test_a_sampled_flat_plan_adds_up_and_its_captured_layers_stand_for_all() -> None:
    """Llama-3-8B on 8 devices, 3 of 32 layers captured: the rows sum to the step; the layer rows run 32 times in
    all (the captured ones for their copies), with 4 micro-batches 4 x 32."""
    kw = dict(cluster="h100-sxm:1x8", seq=1024, global_batch=16, time_limit_s=10)
    flat = autoshard.plan("llama3-8b", **kw)
    assert flat.sampled_layers and flat.microbatches == 1
    _rows_add_up(flat)
    assert flat.step_time_s == pytest.approx(sum(r.per_step_s for r in flat.stages[0].layer_times), rel=1e-9)
    layers = [r for r in flat.stages[0].layer_times if r.name.startswith("layers.")]
    assert sum(r.runs for r in layers) == pytest.approx(32)
    four = autoshard.plan("llama3-8b", **kw, microbatches=4)
    _rows_add_up(four)
    assert sum(r.runs for r in four.stages[0].layer_times if r.name.startswith("layers.")) == pytest.approx(4 * 32)


def test_a_pipelined_3d_plan_adds_up_per_stage_and_each_copy_carries_its_own_work() -> None:
    """pp=2 x dp=2 x tp=8 on 32 H100s: per stage the rows add up to its compute and communication; a layer's row
    runs once per micro-batch, its gradient reductions once a step; copies of one captured layer are equal (the
    page once put every copy's collectives on the stage's last layer); boundary sends and the optimizer update
    have rows of their own."""
    plan = autoshard.plan(
        "llama3-8b",
        cluster="h100-sxm:4x8",
        seq=1024,
        global_batch=64,
        mesh={"pp": 2, "dp": 2, "tp": 8},
        time_limit_s=10,
    )
    assert len(plan.stages) == 2 and plan.sampled_layers
    _rows_add_up(plan)
    b = plan.microbatches
    for s in plan.stages:
        rows = {r.name: r for r in s.layer_times}
        layers = [r for r in s.layer_times if r.name.startswith("layers.")]
        assert [r.name for r in layers] == [n for n in s.layers if n.startswith("layers.")]
        assert all(r.runs == b for r in s.layer_times)
        assert all(r.step_s > 0 for r in layers)  # dp=2: each layer's gradients reduced once a step
        copies = [r for r in layers if r.name not in ("layers.30", "layers.31")]  # (copies of captured layer 0)
        assert len({(round(r.run_s, 12), round(r.step_s, 12)) for r in copies}) == 1
        assert rows["stage boundary sends"].per_step_s > 0 and rows["optimizer step"].step_s > 0
        # a micro-batch's work on the stage is within its predicted time per micro-batch
        assert sum(r.run_s for r in s.layer_times) <= s.microbatch_time_s * (1 + 1e-9)
    page = render_html(plan)
    assert page.count('data-view="layers"') == 2 and "of work per step (2 micro-batches" in page
