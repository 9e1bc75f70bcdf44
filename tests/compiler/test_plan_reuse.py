"""Plans that can be kept and reused (issue 14 part 3): ``compile(..., plan=Plan.from_json(text))`` runs a saved plan
without solving, refuses one made for another program naming what differs, and the same inputs give the same
plan text (wall-clock fields aside)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from harness import local_ranks
from numerics_utils import MODELS
from torch.distributed.device_mesh import init_device_mesh

import autoshard
from autoshard.plans.fingerprint import canonical_json, digest
from autoshard.plans.plan import Plan

# a saved plan with more than placements in it: recomputed layers, ZeRO-2 gradient and state layouts
SAVED = {"recompute": ["layers"], "recipe": "zero2"}


def test_saved_plan_runs_without_solving_and_trains_the_same() -> None:
    make, inputs_fn = MODELS["gpt"]
    inputs = inputs_fn()  # outside LocalTensorMode: the same global batch on every simulated rank
    with local_ranks(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        first = autoshard.compile(make(), mesh, inputs, backend="eager", **SAVED)
        saved = Plan.from_json(first.plan.to_json())
        again = autoshard.compile(make(), mesh, inputs, backend="eager", plan=saved)
        losses = [m.step(*inputs) for m in (first, again)]
        grads = [{n: p.grad.full_tensor() for n, p in m.named_parameters()} for m in (first, again)]
    assert saved.recompute_layers and again.plan.recompute_layers == saved.recompute_layers
    assert again.plan.solver.status == "REUSED" and saved.solver.status == "OPTIMAL"
    assert {t.zero for t in saved.stages[0].tensors if t.role == "parameter" and t.shape[0] % 2 == 0} == {"zero2"}
    assert again.plan.stages == saved.stages and again.plan.step_time_s == pytest.approx(saved.step_time_s)
    assert torch.equal(losses[0], losses[1])
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_a_plan_for_another_program_is_refused_naming_what_differs() -> None:
    make, inputs_fn = MODELS["gpt"]
    tokens, targets = inputs_fn()
    with local_ranks(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        saved = autoshard.plan(make(), mesh, (tokens, targets))
        with pytest.raises(
            ValueError, match=r"inputs: the plan's 'args\[0\] int64\[8, 16\].*now 'args\[0\] int64\[4, 16\]"
        ):
            autoshard.compile(make(), mesh, (tokens[:4], targets[:4]), backend="eager", plan=saved)
        with pytest.raises(ValueError, match=r"options: .*bfloat16"):
            autoshard.compile(make(), mesh, (tokens, targets), backend="eager", plan=saved, mixed_precision="bf16")
        # a plan whose fingerprint was dropped is still checked decision by decision
        stage = saved.stages[0]
        bad = dataclasses.replace(stage.ops[0], output=("S(5)",))
        tampered = dataclasses.replace(
            saved, fingerprint=(), stages=(dataclasses.replace(stage, ops=(bad, *stage.ops[1:])),)
        )
        with pytest.raises(ValueError, match=rf"plan= asks {bad.node} .*not one of its"):
            autoshard.compile(make(), mesh, (tokens, targets), backend="eager", plan=tampered)


def test_the_same_inputs_give_the_same_plan_text() -> None:
    make, inputs_fn = MODELS["gpt"]
    with local_ranks(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        a, b = (autoshard.plan(make(), mesh, inputs_fn()) for _ in range(2))
    assert canonical_json(a) == canonical_json(b) and digest(a) == digest(b)
    ja, jb = json.loads(a.to_json()), json.loads(b.to_json())
    ja["solver"]["wall_s"] = jb["solver"]["wall_s"] = 0.0
    assert ja == jb  # only the wall clock differs
    assert dict(a.fingerprint)["mesh"] == "dp=2" and "int64[8, 16]" in dict(a.fingerprint)["inputs"]


def test_a_saved_zoo_plan_replays_offline_with_its_own_choices() -> None:
    """Llama-3-8B on (8, 8), planned offline (under the H100's memory) and replayed from its JSON: the replay takes
    no budget (it was refused for the recomputation the search tried) and, where candidates agree on the layouts
    a plan names but one holds a view DTensor offers as _StridedShard, the one a plan can name (it crashed)."""
    saved = autoshard.plan("llama3-8b", mesh=(8, 8), cluster="h100-sxm:8x8", global_batch=64)
    again = autoshard.plan(
        "llama3-8b", mesh=(8, 8), cluster="h100-sxm:8x8", global_batch=64, plan=Plan.from_json(saved.to_json())
    )
    assert again.solver.status == "REUSED"
    assert again.step_time_s == pytest.approx(saved.step_time_s, rel=1e-9)
    assert again.parameter_placements() == saved.parameter_placements()
